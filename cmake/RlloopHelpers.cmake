# Small helpers shared by every module's CMakeLists.txt.

# rlloop_export(<target> <alias-name>): namespaced alias rlloop::<alias-name>, installed and exported.
function(rlloop_export target alias_name)
  add_library(rlloop::${alias_name} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${alias_name})
  set_property(GLOBAL APPEND PROPERTY RLLOOP_EXPORTED_TARGETS ${target})
endfunction()

# rlloop_add_test(<name> SOURCES ... LIBS ... [TIMEOUT s] [LABELS ...] [EXTERNAL_DATA]): one GoogleTest binary =
# one CTest test. Deliberately not gtest_discover_tests: every process linked to LibTorch costs ~1 s to start.
# EXTERNAL_DATA: the binary reads data the repository does not hold (tests/external_data.hpp); when its tests
# skip for want of it, CTest reports the binary as skipped, not passed. Each test's start is printed (no
# --gtest_brief): `ctest --output-on-failure` shows only failed binaries' output, and for one that timed out the
# last "[ RUN ]" line is the test that hung.
function(rlloop_add_test name)
  cmake_parse_arguments(T "EXTERNAL_DATA" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  find_package(GTest REQUIRED)
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)  # external_data.hpp
  target_compile_definitions(${name} PRIVATE RLLOOP_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                                             RLLOOP_BINARY_DIR="${PROJECT_BINARY_DIR}")
  add_test(NAME ${name} COMMAND ${name} WORKING_DIRECTORY ${PROJECT_BINARY_DIR})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}")
  if(T_EXTERNAL_DATA)
    set_tests_properties(${name} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
  endif()
endfunction()

# rlloop_add_child_directories(): adds every sub-folder of the current one that has a CMakeLists.txt
# (tests/, bench/, examples/: one independent folder per module or example).
function(rlloop_add_child_directories)
  file(GLOB children LIST_DIRECTORIES true CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*)
  foreach(child ${children})
    if(IS_DIRECTORY ${child} AND EXISTS ${child}/CMakeLists.txt)
      add_subdirectory(${child})
    endif()
  endforeach()
endfunction()
