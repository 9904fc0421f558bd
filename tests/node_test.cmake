# Tests whose reference runs in Node.js (npm packages that `scripts/setup.sh --tests` installs: llama.cpp's prebuilt
# build, the tokenizers of transformers.js). Where node is missing such a test still exists and says so, rather than
# vanishing from ctest's list: "node missing", skipped (exit 77) outside CI, failed under CI=true, where a reference
# that did not run is a failure; a REQUIRED test fails everywhere (its comment says it never skips).
#
#   rlloop_node_test(<name> [REQUIRED] COMMAND <command> <args>...)
find_program(RLLOOP_NODE NAMES node nodejs)

function(rlloop_node_test name)
  cmake_parse_arguments(ARG "REQUIRED" "" "COMMAND" ${ARGN})
  if(RLLOOP_NODE)
    add_test(NAME ${name} COMMAND ${ARG_COMMAND})
  elseif(ARG_REQUIRED)
    add_test(NAME ${name} COMMAND sh -c "echo '${name}: node missing (install Node.js and run scripts/setup.sh --tests)' >&2; exit 1")
  else()
    add_test(NAME ${name}
             COMMAND sh -c "echo '${name}: node missing (install Node.js and run scripts/setup.sh --tests); \
skipped outside CI, a failure under CI=true' >&2; [ \"$CI\" = true ] && exit 1; exit 77")
  endif()
  set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77)
endfunction()
