/* graph_replay.h - a recorded graph's replay as a C callable: the runner of an entry
 * compiled for CUDA graphs (nnscaler_eval/runners/backends.py records the graph).
 *
 * A recording reads its inputs from fixed buffers and writes its outputs into fixed
 * buffers.  GraphReplay(inputs, replay, written, outputs) is called with the graph's
 * inputs, as the recorded graph would be, and:
 *   - copies each argument that is not already its buffer's memory (same data
 *     pointer, sizes, strides, dtype, device: a static KV cache passed every call)
 *     into the buffer, refusing other sizes (the call key guarantees the recorded
 *     ones on a hit; anyone else gets a ValueError, never a broadcast);
 *   - calls replay() (torch.cuda.CUDAGraph.replay: its RNG seed and offset handling
 *     is torch's);
 *   - copies back into each argument the buffers the graph writes in place
 *     (`written`), unless the argument is the buffer;
 *   - returns clones of the outputs as a tuple, or the one output itself with
 *     `single=True` (the next replay overwrites the buffers: torch's rule for CUDA
 *     graph outputs); a value that is not a tensor is returned as it is.
 * An input that is not a tensor (an int size of a dynamic capture recorded per
 * size) is part of the recording: its argument must equal it.  Parameters and
 * buffers are not inputs (the graph reads them in place).
 *
 * `pinned` inputs (tensors marked with torch._dynamo.mark_static_address: a static
 * KV cache) have the caller's own tensor as their buffer: never copied in or back.
 * When a pinned input's argument is not that tensor's memory, nothing is copied and
 * `moved(*inputs)` answers instead (runners/backends.py records the graph again for
 * the new tensors); copying into the caller's earlier tensor would change it behind
 * their back.
 *
 * `for_slots(slots, nargs, single)` is the same recording called with a frame's
 * slots, as the C hit path calls an entry's runner: input i is argument slots[i] of
 * the nargs given, and `single` returns the one output itself, not a tuple.  Such an
 * entry runs no Python frame of this project on a hit (runners/codegen.py decides
 * when the generated runner would only pass slots through).
 *
 * `for_sizes(free, kept_inputs, kept_outputs)` is the same recording run for a call
 * of smaller sizes (a size bucket with padding, nnscaler_eval/runners/size_buckets.py):
 * the views of each buffer's leading positions (`buffer[:n0, :n1]`) are made once,
 * here; a call copies argument i into its input view (other sizes are a ValueError,
 * as for a whole buffer), the positions past it keep what they held, and output i is
 * cloned from its view, a tensor of the call's sizes.  The int inputs in `free` are
 * the call's own sizes and are not compared (the recording runs at its own).
 *
 * replay() is Python in the middle of the call: it may call this object again or drop
 * every other reference to it; the object holds itself for the call. */
#ifndef NNSCALER_GRAPH_REPLAY_H
#define NNSCALER_GRAPH_REPLAY_H

#include <Python.h>

extern PyTypeObject GraphReplay_Type;

#endif
