/* compat_versions.h - the one place where CPython versions are told apart.
 *
 * Turns PY_VERSION_HEX into one name per audited minor version, NNS_PY311 ..
 * NNS_PY314, and NNS_PY_MINOR (11 .. 14) for "from this version on" tests; anything
 * else stops the build.  No other file tests PY_VERSION_HEX (tests/test_lint.py
 * checks this), and only the version layer (compat/) tests these names, each test
 * beside the code it selects, citing the CPython change behind it.  Each minor
 * version's internals are in compat_py3XX.c, which names the release it was
 * audited against.
 */
#ifndef NNSCALER_COMPAT_VERSIONS_H
#define NNSCALER_COMPAT_VERSIONS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
/* CPython 3.11: audited against v3.11.7 (compat_py311.c). Tested. */
#  define NNS_PY311 1
#  define NNS_PY_MINOR 11
#elif PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030D0000
/* CPython 3.12: audited against v3.12.1, the image's pyenv interpreter that
 * `make test-3.12` builds against and tests on (compat_py312.c). Tested. */
#  define NNS_PY312 1
#  define NNS_PY_MINOR 12
#elif PY_VERSION_HEX >= 0x030D0000 && PY_VERSION_HEX < 0x030E0000
/* CPython 3.13: audited against v3.13.15 (compat_py313.c). Tested. */
#  define NNS_PY313 1
#  define NNS_PY_MINOR 13
#elif PY_VERSION_HEX >= 0x030E0000 && PY_VERSION_HEX < 0x030F0000
/* CPython 3.14: audited against v3.14.10 (compat_py314.c). Tested. */
#  define NNS_PY314 1
#  define NNS_PY_MINOR 14
#else
#  error "nnscaler-eval: unaudited CPython version; frame internals must be checked first"
#endif

#ifdef Py_GIL_DISABLED
/* The evaluator's per-thread state and the dict-watcher side table rely on the GIL. */
#  error "nnscaler-eval: free-threaded CPython builds are not supported"
#endif

#endif /* NNSCALER_COMPAT_VERSIONS_H */
