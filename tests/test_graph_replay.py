"""A recorded graph's replay run from C (`_C.GraphReplay`, csrc/graph_replay.h): the
runner of entries compiled for CUDA graphs.  Everything but the recording itself is
tested here on the CPU: a stand-in recording (`cpu_record`) reruns the graph on the
static buffers, writing its outputs into the recorded output tensors, as a CUDA
graph's replay does.  The bookkeeping (copies in, writes back, clones out, refusals)
and the C hit path that calls the replay with no Python frame of ours are the same
code a CUDA entry runs; tests/test_gpu.py runs the real recording on a GPU."""
from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn as nn

import nnscaler
from nnscaler_eval import _C
from nnscaler_eval.runners import backends
from test_direct_calls import entry_runner


def cpu_record(gm, static_inputs):
    """The recording's stand-in: the outputs of one run are the output buffers; a
    replay runs the graph again on the input buffers (in-place writes included) and
    writes its outputs into them."""
    outputs = gm(*static_inputs)

    def replay():
        for buffer, fresh in zip(outputs, gm(*static_inputs)):
            buffer.copy_(fresh)

    return replay, outputs


replays: list = []


def cpu_replay_backend(gm, example_inputs):
    backends.refuse_replay(gm, example_inputs, "cpu")
    replay = backends.replayed(gm, example_inputs, cpu_record)
    replays.append(replay)
    return replay


# -- GraphReplay itself -----------------------------------------------------------------


def doubler():
    """A recording of `out = 2 * a; a += 1` on one input buffer."""
    a, out = torch.zeros(3), torch.zeros(3)
    ran = []

    def replay():
        ran.append(True)
        out.copy_(a * 2)
        a.add_(1)

    return a, out, ran, _C.GraphReplay((a,), replay, (0,), (out,))


def test_replay_copies_in_writes_back_and_clones_out():
    a, out, ran, replay = doubler()
    x = torch.arange(3.0)
    first, = replay(x)
    assert first.tolist() == [0.0, 2.0, 4.0] and x.tolist() == [1.0, 2.0, 3.0]
    second, = replay(x)   # the next replay overwrites the buffers, not `first`
    assert first.tolist() == [0.0, 2.0, 4.0] and second.tolist() == [2.0, 4.0, 6.0]
    assert first.data_ptr() != out.data_ptr() != second.data_ptr()
    assert x.tolist() == [2.0, 3.0, 4.0] and len(ran) == 2


def test_an_argument_at_the_recorded_address_is_not_copied():
    a, out, _, replay = doubler()
    version = a._version
    replay(a)             # the buffer itself: no copy in, no write back
    assert a._version == version + 1          # only the graph's own write
    assert a.tolist() == [1.0, 1.0, 1.0]
    view = torch.zeros(6)[::2]                # same sizes, other memory: copied
    replay(view)
    assert view.tolist() == [1.0, 1.0, 1.0] and a.tolist() == [1.0, 1.0, 1.0]


def test_bad_arguments_say_what_was_wrong_and_leave_the_replay_usable():
    a, _, ran, replay = doubler()
    with pytest.raises(ValueError, match=r"input 0 has sizes \[4\], the recording's \[3\]"):
        replay(torch.ones(4))
    with pytest.raises(ValueError, match=r"sizes \[1\]"):
        replay(torch.ones(1))                 # no broadcast
    with pytest.raises(TypeError, match="takes torch.Tensor arguments, not int"):
        replay(3)
    with pytest.raises(TypeError, match="takes 1 arguments"):
        replay()
    with pytest.raises(TypeError, match="keyword"):
        replay(x=torch.ones(3))
    with pytest.raises(ValueError, match="meta or fake"):
        replay(torch.ones(3, device="meta"))
    assert not ran
    assert replay(torch.ones(3))[0].tolist() == [2.0, 2.0, 2.0]


def test_construction_refuses_what_it_cannot_replay():
    t = torch.zeros(2)
    with pytest.raises(TypeError, match="must be tuples"):
        _C.GraphReplay([t], lambda: None, (), (t,))
    with pytest.raises(TypeError, match="must be callable"):
        _C.GraphReplay((t,), 3, (), (t,))
    with pytest.raises(IndexError, match="written input 1 out of range"):
        _C.GraphReplay((t,), lambda: None, (1,), (t,))
    with pytest.raises(ValueError, match="one output, not 2"):
        _C.GraphReplay((t,), lambda: None, (), (t, t), single=True)
    replay = _C.GraphReplay((t,), lambda: None, (), (t,))
    with pytest.raises(IndexError, match="slot 5 out of range"):
        replay.for_slots((5,), 2, False)
    with pytest.raises(ValueError, match="tuple of 1 indices"):
        replay.for_slots((0, 1), 2, False)


def test_slot_form_picks_its_inputs_and_ignores_the_rest():
    a, _, _, replay = doubler()
    by_slot = replay.for_slots((2,), 4, True)
    x = torch.arange(3.0)
    out = by_slot(object(), "ignored", x, True)
    assert out.tolist() == [0.0, 2.0, 4.0] and x.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match="takes 4 arguments"):
        by_slot(x)


def test_a_bucket_call_copies_into_leading_positions_and_cuts_outputs_back():
    buffer, out = torch.full((2, 4), -1.0), torch.zeros(2, 4)

    def replay():
        out.copy_(buffer.cumsum(1))

    recorded = _C.GraphReplay((buffer, 4), replay, (), (out, 4))
    call = recorded.for_sizes((1,), ((2, 3), None), ((2, 3), None))
    x = torch.arange(6.0).view(2, 3)
    result, four = call(x, 3)     # the int is the call's size: the recording runs at 4
    assert four == 4 and result.shape == (2, 3) and result.is_contiguous()
    assert torch.equal(result, x.cumsum(1))
    assert buffer[:, 3].tolist() == [-1.0, -1.0]          # past the call: left as it was
    view = call.input_views[0]
    assert view.shape == (2, 3) and view.data_ptr() == buffer.data_ptr()
    assert recorded.input_views is None and call.output_views[1] is None
    by_slot = call.for_slots((1, 0), 2, False)          # stays a bucket's call
    assert torch.equal(by_slot(3, x)[0], x.cumsum(1)) and by_slot.input_views == call.input_views
    with pytest.raises(ValueError, match=r"input 0 has sizes \[2, 4\], the recording's \[2, 3\]"):
        call(torch.ones(2, 4), 4)
    with pytest.raises(ValueError, match="size 5 in dimension 1, more than the recording's 4"):
        recorded.for_sizes((), ((2, 5), None), (None, None))
    with pytest.raises(ValueError, match="input 0 has 1 dimensions, the recording's 2"):
        recorded.for_sizes((), ((2,), None), (None, None))
    with pytest.raises(ValueError, match="free input 0 is a tensor"):
        recorded.for_sizes((0,), (None, None), (None, None))
    with pytest.raises(ValueError, match="one entry per output"):
        recorded.for_sizes((), (None, None), (None,))
    with pytest.raises(TypeError, match="tuple of ints or None"):
        recorded.for_sizes((), (None, None), ([2, 3], None))
    with pytest.raises(ValueError, match="output 1 is not a tensor"):
        recorded.for_sizes((), (None, None), (None, (1,)))
    with pytest.raises(IndexError, match="free input 2 out of range"):
        recorded.for_sizes((2,), (None, None), (None, None))
    written = _C.GraphReplay((buffer,), replay, (0,), (out,))
    with pytest.raises(ValueError, match="pinned or written in place"):
        written.for_sizes((), ((2, 3),), (None,))
    class Sub(torch.Tensor):
        pass

    with pytest.raises(TypeError, match="takes torch.Tensor arguments"):
        call(x.as_subclass(Sub), 3)                     # never its __torch_function__

    class Size:
        """A size whose __index__ drops every other reference to the recording, or
        raises: Python in the middle of making the views."""
        def __init__(self, fail):
            self.fail = fail

        def __index__(self):
            nonlocal recorded
            if self.fail:
                raise RuntimeError("no size")
            recorded = None
            gc.collect()
            return 3

    with pytest.raises(RuntimeError, match="no size"):
        recorded.for_sizes((1,), ((2, Size(True)), None), (None, None))
    dropped = recorded.for_sizes((1,), ((2, Size(False)), None), ((2, 3), None))
    assert recorded is None and dropped.input_views[0].shape == (2, 3)
    assert torch.equal(dropped(x, 3)[0], x.cumsum(1))
    assert torch.equal(call(x, 3)[0], x.cumsum(1))      # usable after each refusal
    with pytest.raises(ValueError, match="input 1 is 3, the recording's 4"):
        _C.GraphReplay((buffer, 4), replay, (), (out, 4))(torch.ones(2, 4), 3)   # exact: compares


def test_outputs_that_are_not_tensors_come_back_as_they_are():
    t = torch.ones(2)
    replay = _C.GraphReplay((t,), lambda: None, (), (t, 3, None))
    out, three, none = replay(torch.ones(2))
    assert three == 3 and none is None and out.data_ptr() != t.data_ptr()


def test_python_in_the_middle_reenters_drops_references_and_raises():
    t, out = torch.zeros(2), torch.zeros(2)
    holder: dict = {}
    depth = []

    class Recording:
        def __call__(self):
            depth.append(len(depth))
            if len(depth) == 1:
                inner, = holder["replay"](torch.full((2,), 5.0))   # reentered
                assert inner.tolist() == [5.0, 5.0]
                holder.clear()                                     # the last other reference
                gc.collect()
            out.copy_(t)

    recording = Recording()
    probe = weakref.ref(recording)
    holder["replay"] = _C.GraphReplay((t,), recording, (), (out,))
    del recording
    result, = holder["replay"](torch.ones(2))
    # the outer copy-in happened before the inner one overwrote the buffer
    assert result.tolist() == [5.0, 5.0] and depth == [0, 1]
    assert probe() is None      # freed once the call that held it returned

    class Failing:
        def __call__(self):
            raise RuntimeError("the recording failed")

    failing = Failing()
    failed = weakref.ref(failing)
    broken = _C.GraphReplay((t,), failing, (), (out,))
    del failing
    with pytest.raises(RuntimeError, match="the recording failed"):
        broken(torch.ones(2))
    del broken      # the failed call kept no reference to it: it and its recording go
    gc.collect()
    assert failed() is None


# -- through nnscaler.compile: the runner of a replay entry ----------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).relu() * 2


class Pair(Net):
    def forward(self, x, y):
        h = self.fc(x)
        return h + y, h.sum()


class CacheWriter(Net):
    """A static cache written in place (`index_copy_`), as a decode step's."""

    def forward(self, x, cache, pos):
        cache.index_copy_(0, pos, self.fc(x))
        return cache.sum(0)


class Nested(Net):
    def forward(self, inputs):
        return {"out": self.fc(inputs[0]) + inputs[1]}


@pytest.mark.parametrize("model_cls, make_args", [
    (Net, lambda i: (torch.randn(4, 8),)),
    (Pair, lambda i: (torch.randn(4, 8), torch.randn(4, 8))),
], ids=["one output", "tuple of outputs"])
def test_a_replay_entry_runs_from_c_with_eager_answers(model_cls, make_args):
    eager = model_cls().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend=cpu_replay_backend)
    with torch.no_grad():
        for i in range(4):
            args = make_args(i)
            torch.testing.assert_close(model(*args), eager(*args))
    runner = entry_runner(model)
    assert isinstance(runner, _C.GraphReplay)     # no generated Python in between
    assert nnscaler.cache_info(model).hits == 3
    # outputs handed out earlier are not overwritten by later replays
    with torch.no_grad():
        x = make_args(9)
        first, second = model(*x), model(*make_args(10))
        torch.testing.assert_close(first, eager(*x))
        assert second is not first


def test_a_cache_written_in_place_reaches_the_caller_as_in_eager():
    eager = CacheWriter().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend=cpu_replay_backend)
    cache_e, cache_o = torch.zeros(6, 8), torch.zeros(6, 8)
    with torch.no_grad():
        for step in range(5):
            x, pos = torch.randn(1, 8), torch.tensor([step])
            torch.testing.assert_close(model(x, cache_o, pos), eager(x, cache_e, pos))
            torch.testing.assert_close(cache_o, cache_e)
    assert isinstance(entry_runner(model), _C.GraphReplay)
    assert nnscaler.cache_info(model).hits == 4


def test_parameters_are_read_in_place_not_copied():
    eager = Net().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend=cpu_replay_backend)
    x = torch.randn(2, 8)
    with torch.no_grad():
        model(x)
        for m in (eager, model):
            m.fc.weight.mul_(-1)    # an in-place update (an optimizer step)
        torch.testing.assert_close(model(x), eager(x))
    assert all(p.data_ptr() not in {t.data_ptr() for t in replays[-1].inputs}
               for p in model.parameters())


def test_a_replay_under_a_generated_runner_when_slots_are_not_passed_through():
    eager = Nested().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend=cpu_replay_backend)
    with torch.no_grad():
        for _ in range(3):
            inputs = [torch.randn(2, 8), torch.randn(2, 8)]
            torch.testing.assert_close(model(inputs), eager(inputs))
    runner = entry_runner(model)
    assert not isinstance(runner, _C.GraphReplay) and callable(runner)
    assert nnscaler.cache_info(model).hits == 2


def test_a_recording_is_refused_where_it_could_not_replay():
    """Grad mode with parameters requiring grad: the backend refuses, and the graph
    runs with the eager backend (one warning), with eager's answers and gradients."""
    eager = Net()
    model = nnscaler.compile(copy.deepcopy(eager), backend=cpu_replay_backend)
    x = torch.randn(2, 8)
    with pytest.warns(RuntimeWarning, match="inference only"):
        out = model(x)
    out.sum().backward()
    eager(x).sum().backward()
    torch.testing.assert_close(model.fc.weight.grad, eager.fc.weight.grad)
    assert not isinstance(entry_runner(model), _C.GraphReplay)


# -- pinned inputs: tensors marked with torch._dynamo.mark_static_address --------------


def test_a_pinned_input_is_never_copied_and_a_moved_one_goes_to_moved():
    buffer, out = torch.zeros(3), torch.zeros(3)
    met = []

    def replay():
        out.copy_(buffer + 1)

    def moved(*inputs):
        met.append(inputs)
        return (inputs[0] * 10,)

    replay_ = _C.GraphReplay((buffer,), replay, (), (out,), pinned=(0,), moved=moved)
    version = buffer._version
    assert replay_(buffer)[0].tolist() == [1.0, 1.0, 1.0]
    assert buffer._version == version            # no copy in, none back
    other = torch.ones(3)
    assert replay_(other)[0].tolist() == [10.0, 10.0, 10.0]
    assert met[0][0] is other and buffer.tolist() == [0.0, 0.0, 0.0]
    by_slot = replay_.for_slots((1,), 2, True)
    assert by_slot(None, other).tolist() == [10.0, 10.0, 10.0]   # moved's tuple unpacked
    assert by_slot(None, buffer).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="no `moved` handler"):
        _C.GraphReplay((buffer,), replay, (), (out,), pinned=(0,))(other)
    bad = _C.GraphReplay((buffer,), replay, (), (out,), pinned=(0,), moved=lambda x: x)
    with pytest.raises(TypeError, match="must return a tuple"):
        bad.for_slots((0,), 1, True)(other)
    with pytest.raises(IndexError, match="pinned input 3 out of range"):
        _C.GraphReplay((buffer,), replay, (), (out,), pinned=(3,), moved=moved)
    with pytest.raises(TypeError, match="moved must be callable"):
        _C.GraphReplay((buffer,), replay, (), (out,), pinned=(0,), moved=5)


class CacheAccumulator(Net):
    """A cache written in place by a write that is not idempotent (`index_add_`): a
    recording that ran the graph on the caller's own tensor would show twice."""

    def forward(self, x, cache, pos):
        cache.index_add_(0, pos, self.fc(x))
        return cache.sum(0) * 1.0


def _static(t):
    torch._dynamo.mark_static_address(t)
    return t


def test_a_static_address_cache_is_pinned_and_each_new_one_recorded_once():
    from nnscaler_eval.runners import backends as b

    eager = CacheAccumulator().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend=cpu_replay_backend)
    caches = [(_static(torch.zeros(6, 8)), torch.zeros(6, 8)) for _ in range(b.MOVED_RECORDINGS + 3)]
    first = caches[0][0]
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="least recently used"):
        for ours, theirs in caches + caches[:2]:           # new caches, then old ones again
            for step in range(3):
                x, pos = torch.randn(1, 8), torch.tensor([step])
                torch.testing.assert_close(model(x, ours, pos), eager(x, theirs, pos))
                torch.testing.assert_close(ours, theirs)  # written once per call
    replay = replays[-1]
    assert replay.pinned == (1,) and replay.inputs[1] is first
    assert isinstance(entry_runner(model), _C.GraphReplay)
    version = first._version
    with torch.no_grad():
        model(torch.randn(1, 8), first, torch.tensor([5]))
    assert first._version == version + 1                  # the graph's write only: no copies


@dataclasses.dataclass
class Cache:
    buf: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(6, 8))


class CacheObjectWriter(Net):
    """A cache object passed in, its buffer written in place: the buffer is pinned
    (state reached through an argument's attribute, written by the graph)."""

    def forward(self, x, cache, pos):
        cache.buf.index_add_(0, pos, self.fc(x))
        return cache.buf.sum(0) + x


def test_a_cache_objects_written_buffer_is_pinned_and_a_new_cache_recorded_once():
    eager = CacheObjectWriter().eval()
    model = nnscaler.compile(copy.deepcopy(eager), backend=cpu_replay_backend)
    before = len(replays)
    with torch.no_grad():
        for _ in range(3):                                   # a new cache per "generate"
            ours, theirs = Cache(), Cache()
            for step in range(4):
                x, pos = torch.randn(1, 8), torch.tensor([step])
                torch.testing.assert_close(model(x, ours, pos), eager(x, theirs, pos))
                torch.testing.assert_close(ours.buf, theirs.buf)
            version = ours.buf._version
            model(torch.randn(1, 8), ours, torch.tensor([5]))
            assert ours.buf._version == version + 1          # no copies in or back
    replay = replays[before]
    assert replay.pinned == (1,) and replay.written == (1,)
    assert len(replay.moved.__self__.moved) == 2             # one recording per later cache
    assert nnscaler.cache_info(model).captures == 1


def test_generate_with_a_static_cache_through_a_replay_equals_eager():
    """transformers' StaticCache through the replay: its buffers are pinned in the
    decode step (never copied), each generate()'s new cache recorded once; tokens and
    scores equal eager's."""
    from test_kv_cache_inputs import _generate_equal, _model

    torch.manual_seed(0)
    reference = _model("llama").eval()
    compiled = nnscaler.compile(copy.deepcopy(reference), backend=cpu_replay_backend)
    before = len(replays)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True, cache_implementation="static")
    _generate_equal(compiled, reference, (12, 5, 9), kwargs)
    decode = [r for r in replays[before:] if len(r.inputs) > 6]
    assert len(decode) == 1 and len(decode[0].pinned) == 6   # 2 layers' keys, values, lengths
    assert set(decode[0].pinned) == set(decode[0].written)
    assert len(decode[0].moved.__self__.moved) == 2          # the two later generate() calls
