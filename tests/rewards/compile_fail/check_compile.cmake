# Usage: cmake -DCXX=... -DINCLUDES=a;b -DGOOD=good.cpp -DBAD=bad.cpp -DEXPECT=regex -P check_compile.cmake
# Passes when GOOD compiles and BAD fails to compile with EXPECT in the diagnostics.
set(flags -std=c++20 -fsyntax-only)
foreach(dir ${INCLUDES})
  if(dir)
    list(APPEND flags -I${dir})
  endif()
endforeach()

execute_process(COMMAND ${CXX} ${flags} ${GOOD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "control file ${GOOD} should compile but did not:\n${out}")
endif()

execute_process(COMMAND ${CXX} ${flags} ${BAD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0)
  message(FATAL_ERROR "${BAD} compiled, but a non-reward must be rejected")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "${BAD} failed to compile, but the diagnostic does not name '${EXPECT}':\n${out}")
endif()
string(REGEX MATCH "[^\n]*${EXPECT}[^\n]*" line "${out}")
message(STATUS "rejected as expected: ${line}")
