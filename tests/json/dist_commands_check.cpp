// Compiled only by the test dist_unbound_operation_compile_fail, with the throwaway rlloop::op::Test appended to
// the operations (RLLOOP_TEST_OPERATION): the group's command table has no entry for it, so this must not compile.
#include "dist/operation_commands.hpp"
