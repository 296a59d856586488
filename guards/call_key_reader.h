/* call_key_reader.h - reading a per-call key's bytes back (call_key.h builds them;
 * call_key_format.h lays them out): the key in words, the pins of a key built
 * without them, and where its fields lie.  Only the miss path, logs, explain() and
 * the dynamic-shape planning use these; the hit path compares the bytes and never
 * reads them.
 */
#ifndef NNSCALER_CALL_KEY_READER_H
#define NNSCALER_CALL_KEY_READER_H

#include "call_key.h"

/* Give a key built without CALL_KEY_PINS the pins a build with it would have
 * collected, read from its own bytes: the addresses it names are pinned in order.
 * Only sound when no code ran since the build began (CALL_KEY_RAN_PYTHON unset):
 * then every object the key names is still the one reachable from the arguments, at
 * that address.  0, or -1 with an exception set.  Runs no Python before it holds
 * every object it pins (the pins' allocation may run the GC). */
int call_key_pin_from_bytes(CallKey *key);

/* The key in words, decoded from the bytes the hit path compares: a new reference to
 * a tuple of str,
 * "grad_mode: True" and then one line per argument value, "name: description" with
 * `names` (a tuple of str, borrowed, or NULL: "#i: ...").  Addresses the key pins are
 * named through `pins` (borrowed list or NULL); nothing else is dereferenced.  Runs no
 * Python code: no attribute of any argument is read.  NULL with an exception set. */
PyObject *call_key_describe(const unsigned char *data, size_t len, PyObject *pins,
                            PyObject *names);

/* Where the fields a dynamic entry may make symbolic lie (shape_guards.h): a new
 * reference to a tuple with one item per argument value, ("tensor", offset of its
 * sizes, ndim) for a tensor read in C++ (its strides follow its sizes), ("int",
 * offset) for an int, ("float", offset) for a float (a double), ("other", offset of
 * its record) for anything else.  Runs no Python; NULL with an exception set (a
 * malformed key). */
PyObject *call_key_layout(const unsigned char *data, size_t len);

/* The fields inside structured objects (TAG_STRUCT, call_key_set_struct_types), which
 * call_key_layout reports as one "other" item: ("tensor", sizes offset, ndim, path),
 * ("int", offset, path), ("float", offset, path), in key order; `path` is the top-level
 * value's index, then steps ("a", attribute name), ("k", dict key) or ("i", index).
 * New reference; runs no Python; NULL with an exception set (a malformed key). */
PyObject *call_key_nested_layout(const unsigned char *data, size_t len);

#endif
