/* Callgrind client requests for benchmarks/bench_ir.py, loaded with ctypes.  Built on
 * the fly (gcc, valgrind's headers) into build/bench_ir/; a no-op outside valgrind. */
#include <valgrind/callgrind.h>

void cgmark_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cgmark_zero(void) { CALLGRIND_ZERO_STATS; }
void cgmark_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
int cgmark_on_valgrind(void) { return (int)RUNNING_ON_VALGRIND; }
