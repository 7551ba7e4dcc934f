"""gemslib.passes.step_graph: a compiled step replayed from a CUDA graph of its own (the
backend option gemslib.step_graphs). On the CPU the graph is a stand-in that reruns the step
on the captured inputs and rewrites the captured outputs, as a replay does; the GPU test
compiles a module with the option and checks it against eager."""

import importlib
import logging

import pytest
import torch

from helpers import DEVICE, ON_GPU
from gemslib.passes import step_graph


class _ReplayedStep:
    """A CUDA graph's stand-in: ``replay()`` reruns the captured step on the inputs it was
    captured with and writes the results into the captured outputs. The capture has to run
    the step to have outputs; the replay right after it then stands for that run (a real
    capture runs nothing), so each call runs the step once, its writes to the inputs too."""

    def __init__(self):
        self.step = None
        self.outputs = None
        self.replays = 0
        self.ran_at_capture = False

    def replay(self):
        self.replays += 1
        if self.ran_at_capture:
            self.ran_at_capture = False
            return
        for captured, new in zip(step_graph._flat(self.outputs), step_graph._flat(self.step())):
            captured.copy_(new)


@pytest.fixture
def graphs(monkeypatch):
    """The stand-in graphs made, in order; CPU tensors taken as if on the GPU."""
    made = []

    def new_graph():
        made.append(_ReplayedStep())
        return made[-1]

    def record(graph, stream, step):
        graph.step = step
        graph.outputs = step()
        graph.ran_at_capture = True
        return graph.outputs

    monkeypatch.setattr(step_graph, "_new_graph", new_graph)
    monkeypatch.setattr(step_graph, "_side_stream", lambda: None)
    monkeypatch.setattr(step_graph, "_on_stream", lambda stream, step: step())
    monkeypatch.setattr(step_graph, "_record", record)
    monkeypatch.setattr(step_graph, "_on_gpu", lambda tensor: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    return made


@pytest.fixture
def made(monkeypatch):
    """The StepGraphs made (StepGraphs makes one a size), in order."""
    runners = []

    class Counted(step_graph.StepGraph):
        def __init__(self, compiled):
            super().__init__(compiled)
            runners.append(self)

    monkeypatch.setattr(step_graph, "StepGraph", Counted)
    return runners


def _tiny_llama_steps(calls: int = 5):
    """(model, prompt ids, the decode module): a tiny Llama's static-cache step compiled with
    backend="gemslib" and mode="reduce-overhead", called ``calls`` times at one fill, each
    call's logits checked against eager's."""
    from benchmark import decode, realmodels

    spec = realmodels.model_spec("llama3-8b", tiny=True, layers=None)
    model = realmodels.build_model(spec, DEVICE.type, torch.float32).eval()
    ids = realmodels.input_ids(spec, 1, 12, DEVICE)
    with torch.no_grad():
        expected = decode._step_runner("eager", model, ids, 16)[0]()
        step, rewind = decode._step_runner("static-gemslib", model, ids, 16)
        for _ in range(calls):
            rewind()
            torch.testing.assert_close(step(), expected, rtol=1e-4, atol=1e-4)
    return model, ids, decode


def _projection(weight, x):
    return (x @ weight + 1, x.sum())


def test_a_step_is_captured_once_then_replayed_with_its_moving_inputs_copied_in(graphs):
    weight = torch.randn(8, 4)
    runner = step_graph.StepGraph(_projection)
    kept = []
    for call in range(6):
        x = torch.randn(3, 8)  # a new tensor each call: a moving input
        out, total = runner(weight, x)
        torch.testing.assert_close(out, x @ weight + 1)
        torch.testing.assert_close(total, x.sum())
        kept.append((x, out.clone(), out))
    assert len(graphs) == 1 and graphs[0].replays == 6 - step_graph.WARMUP_CALLS
    assert runner.moving_indices == [1] and runner.static_indices == [0]
    # every call's output is its own: the graph's buffers are never handed out, so what a
    # caller kept is not rewritten by later replays
    captured = graphs[0].outputs[0]
    for x, value, out in kept:
        assert out.data_ptr() != captured.data_ptr()
        torch.testing.assert_close(out, value)


def test_a_static_input_at_another_address_is_captured_again_as_a_moving_one(graphs, caplog):
    def step(weight, bias, x):
        return (x @ weight + bias,)

    weight, bias, x = torch.randn(8, 4), torch.randn(4), torch.randn(3, 8)
    runner = step_graph.StepGraph(step)
    for _ in range(3):
        runner(weight, bias, x)
    assert runner.moving_indices == [] and len(graphs) == 1
    for recapture, moved in enumerate(("weight", "bias"), start=1):
        if moved == "weight":
            weight = torch.randn(8, 4)  # a new tensor where a static one was
        else:
            bias = torch.randn(4)
        (out,) = runner(weight, bias, x)
        torch.testing.assert_close(out, x @ weight + bias)
        assert len(graphs) == 1 + recapture, moved
    assert runner.moving_indices == [0, 1] and runner.static_indices == [2]
    weight = torch.randn(8, 4)  # moving now: copied in, no capture
    (out,) = runner(weight, bias, x)
    torch.testing.assert_close(out, x @ weight + bias)
    assert len(graphs) == 3
    # a static input moving once more after the last recapture: no graph from then on
    x = torch.randn(3, 8)
    with caplog.at_level(logging.WARNING, logger="gemslib.passes"):
        (out,) = runner(weight, bias, x)
    torch.testing.assert_close(out, x @ weight + bias)
    assert runner.unsafe is not None and "recaptures" in caplog.text and len(graphs) == 3
    x = torch.randn(3, 8)
    torch.testing.assert_close(runner(weight, bias, x)[0], x @ weight + bias)


def test_an_input_that_is_not_a_tensor_is_held_to_its_captured_value(graphs):
    """A dynamic size comes as a plain number at run time: the graph holds the captured one,
    so a call with another does not replay it (it warms up a StepGraph of its own)."""
    def scaled(weight, x, n):
        return (x @ weight * n,)

    weight = torch.randn(8, 4)
    runner = step_graph.StepGraphs(scaled)
    for n in (3, 3, 3, 3, 5, 3):
        x = torch.randn(3, 8)
        torch.testing.assert_close(runner(weight, x, n)[0], x @ weight * n)
    assert len(graphs) == 1 and graphs[0].replays == 3 and runner.unsafe is None  # not call 5


def test_a_moving_input_of_another_layout_runs_without_the_graph(graphs):
    weight = torch.randn(8, 4)
    runner = step_graph.StepGraph(_projection)
    for _ in range(3):
        runner(weight, torch.randn(3, 8))
    replays = graphs[0].replays
    wider = torch.randn(5, 8)
    out, _ = runner(weight, wider)
    torch.testing.assert_close(out, wider @ weight + 1)
    assert graphs[0].replays == replays and runner.unsafe is None


@pytest.mark.parametrize("case", ["alias", "written", "failed capture"])
def test_a_step_it_cannot_capture_safely_runs_without_a_graph(case, graphs, monkeypatch):
    weight = torch.randn(8, 4)

    def aliasing(w, x):  # an output that is a view of an input
        return (x @ w, w.view(-1))

    def writing(w, x):  # writes its moving input (as a cache update would)
        out = x @ w
        x.add_(1)
        return (out,)

    step = {"alias": aliasing, "written": writing}.get(case, _projection)
    if case == "failed capture":
        def failing(graph, stream, step):
            raise RuntimeError("operation not permitted when stream is capturing")
        monkeypatch.setattr(step_graph, "_record", failing)
    runner = step_graph.StepGraph(step)
    for _ in range(5):
        x = torch.randn(3, 8)
        before = x.clone()
        torch.testing.assert_close(runner(weight, x)[0],
                                   before @ weight + (case == "failed capture"))
        if case == "written":  # the caller's own tensor took the write
            torch.testing.assert_close(x, before + 1)
    assert runner.unsafe is not None and runner.graph is None
    assert {"alias": "aliases", "written": "written by the step",
            "failed capture": "capture failed"}[case] in runner.unsafe


def test_a_symbolic_size_or_a_tensor_off_the_gpu_is_refused_before_any_capture(graphs,
                                                                               monkeypatch):
    weight = torch.randn(8, 4)
    size = torch.fx.experimental.symbolic_shapes.ShapeEnv().create_unbacked_symint()
    runner = step_graph.StepGraph(lambda w, x, n: _projection(w, x))
    runner(weight, torch.randn(3, 8), size)
    assert "symbolic" in runner.unsafe and not graphs
    monkeypatch.setattr(step_graph, "_on_gpu", lambda tensor: tensor.is_cuda)
    runner = step_graph.StepGraph(_projection)
    x = torch.randn(3, 8)
    torch.testing.assert_close(runner(weight, x)[0], x @ weight + 1)
    assert "not a CUDA device" in runner.unsafe and not graphs


def test_the_backend_replays_an_inference_graph_from_its_own_cuda_graph(made):
    """With gemslib.step_graphs and CUDA graphs on, a GPU inference graph runs in a StepGraph
    (captured after its warm-up calls, then replayed) and gives eager's answers call after
    call; a CPU graph keeps inductor's path (no StepGraph); a value that is not True, False
    or "auto" is refused, naming the option."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.SiLU()).to(DEVICE)
    options = {"gemslib.step_graphs": True, "triton.cudagraphs": True}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="gemslib", options=options)
    kept = []
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(16, 64, device=DEVICE)
            out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
            kept.append((out, model(x)))
    for out, expected in kept:  # earlier outputs are not rewritten by later replays
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    if ON_GPU:
        assert len(made) == 1 and made[0].graph is not None and made[0].unsafe is None
    else:
        assert not made
    torch._dynamo.reset()
    with pytest.raises(Exception, match="gemslib.step_graphs"):
        torch.compile(model, backend="gemslib",
                      options={"gemslib.step_graphs": "yes", "triton.cudagraphs": True})(x)
    torch._dynamo.reset()


def _backend_module():
    return importlib.import_module("gemslib.passes.backend")  # the package's name is the function's


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), ("", "auto"),
                                             (None, "auto")])
def test_the_environment_gives_the_step_graphs_default(value, expected, monkeypatch):
    """GEMSLIB_STEP_GRAPHS: "1" -> True, "0" -> False, unset or empty -> "auto"; any other
    value is refused, naming the variable."""
    backend = _backend_module()
    if value is None:
        monkeypatch.delenv("GEMSLIB_STEP_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("GEMSLIB_STEP_GRAPHS", value)
    default = backend.step_graphs_default()
    assert type(default) is type(expected) and default == expected
    monkeypatch.setenv("GEMSLIB_STEP_GRAPHS", "yes")
    with pytest.raises(ValueError, match="GEMSLIB_STEP_GRAPHS"):
        backend.step_graphs_default()


@pytest.mark.parametrize("value", ["on", 1, None])
def test_the_step_graphs_option_takes_true_false_or_auto_only(value):
    backend = _backend_module()
    gm = torch.fx.symbolic_trace(torch.nn.SiLU())
    with pytest.raises(ValueError, match="gemslib.step_graphs.*'auto'"):
        backend.backend(gm, [torch.randn(2)], options={"gemslib.step_graphs": value})


def test_the_outputs_bytes_are_read_from_the_output_nodes_values():
    """Sum of numel x element size over the tensor outputs; None where a tensor output has
    no value (a graph not traced by dynamo) or a symbolic size."""
    backend = _backend_module()
    gm = torch.fx.symbolic_trace(lambda x: (x + 1, x.sum()))
    assert backend._outputs_bytes(gm) is None
    first, second = gm.graph.find_nodes(op="output")[0].args[0]
    first.meta["example_value"] = torch.empty(3, 4, dtype=torch.bfloat16)
    second.meta["val"] = 7  # not a tensor: no bytes
    assert backend._outputs_bytes(gm) == 3 * 4 * 2
    size = torch.fx.experimental.symbolic_shapes.ShapeEnv().create_unbacked_symint()
    second.meta["val"] = torch.empty(size, device="meta")
    assert backend._outputs_bytes(gm) is None


class _LinearAndItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.nn.functional.silu(self.linear(x)), x[:1]


@pytest.mark.parametrize("case", ["small", "large", "dynamic", "alias"])
def test_auto_gives_a_step_graph_to_small_outputs_of_static_sizes_only(case, graphs, made,
                                                                       monkeypatch):
    """With the option at its default ("auto"), CUDA graphs on and the graph taken as on the
    GPU: outputs of static sizes totalling at most AUTO_OUTPUT_BYTES (here 16 x 64 fp32, 4096
    bytes, the bound set to that) get a StepGraph; one byte over the bound, sizes symbolic
    at compile time (dynamic=True), or an output that is a view of an input (which a step
    graph refuses at its capture) keep inductor's path. Each call eager's."""
    backend = _backend_module()
    monkeypatch.setattr(backend, "_on_cuda", lambda example_inputs: True)
    monkeypatch.delenv("GEMSLIB_STEP_GRAPHS", raising=False)
    monkeypatch.setattr(backend, "AUTO_OUTPUT_BYTES",
                        17 * 64 * 4 if case == "alias" else 16 * 64 * 4 - (case == "large"))
    model = _LinearAndItsInput() if case == "alias" else \
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.SiLU())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="gemslib", dynamic=case == "dynamic",
                             options={"triton.cudagraphs": True})
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(16, 64)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    if case == "small":
        assert len(made) == 1 and made[0].unsafe is None
        assert len(graphs) == 1 and graphs[0].replays == 4 - step_graph.WARMUP_CALLS
    else:
        assert not made and not graphs
    torch._dynamo.reset()


def test_a_static_cache_decode_step_in_its_own_graph_gives_eagers_logits(made, monkeypatch):
    """A tiny Llama's static-cache decode step compiled with backend="gemslib" and
    mode="reduce-overhead", GEMSLIB_STEP_GRAPHS=1: on the GPU the step runs in one StepGraph
    (its cache written in place, every input static here), each replay's logits eager's; on
    the CPU inductor's path as before, the same logits."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("GEMSLIB_STEP_GRAPHS", "1")
    model, ids, decode = _tiny_llama_steps()
    if ON_GPU:
        assert len(made) == 1 and made[0].unsafe is None and made[0].graph is not None
    else:
        assert not made
    torch._dynamo.reset()


def test_the_backend_hands_a_compiled_decode_step_to_a_step_graph_that_replays_it(graphs, made,
                                                                                   monkeypatch):
    """The integration on any device: the backend's compiled static-cache step (dynamo's
    positional inputs, AOTAutograd's outputs, the cache written in place) in a StepGraph over
    the stand-in graph, taken as on the GPU: captured once after its warm-up, every input
    static, nothing refused, each replay's logits eager's."""
    pytest.importorskip("transformers")
    import sys

    backend = sys.modules["gemslib.passes.backend"]  # the package's name is the function's

    monkeypatch.setattr(backend, "_on_cuda", lambda example_inputs: True)
    monkeypatch.setenv("GEMSLIB_STEP_GRAPHS", "1")
    model, ids, decode = _tiny_llama_steps()
    assert len(made) == 1 and made[0].unsafe is None, made and made[0].unsafe
    assert len(graphs) == 1 and graphs[0].replays == 5 - step_graph.WARMUP_CALLS
    assert made[0].moving_indices == [] and made[0].written  # the cache, written in place
    torch._dynamo.reset()

    # generate()'s way: the token, its mask and its position new tensors every step, so they
    # move (copied into their twins), and the steps walk through the cache (the mask over the
    # whole cache, one size: a growing one would make each step a size of its own)
    made.clear()
    token, mask = decode._step_inputs(1, 12, DEVICE)
    with torch.no_grad():
        eager_cache = decode._prefilled_cache(model, ids, True, 20)
        cache = decode._prefilled_cache(model, ids, True, 20)
        compiled = torch.compile(model, **decode.static_compile_arguments("static-gemslib"))
        for position in range(12, 18):
            arguments = dict(input_ids=token + position, cache_position=torch.tensor(
                [position], device=DEVICE), attention_mask=torch.ones(
                    1, 20, dtype=torch.long, device=DEVICE), use_cache=True)
            expected = model(past_key_values=eager_cache, **arguments).logits
            got = compiled(past_key_values=cache, **arguments).logits
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert len(made) >= 1 and all(runner.unsafe is None for runner in made), \
        [runner.unsafe for runner in made]
    assert any(runner.moving_indices for runner in made)
    torch._dynamo.reset()


def test_each_set_of_dynamic_sizes_gets_a_graph_of_its_own_up_to_a_limit(graphs, monkeypatch,
                                                                          caplog):
    """A step compiled with dynamic sizes gets their values as numbers: each value gets its
    own StepGraph (warmed up, captured, replayed), a value past SIZES runs without one, and
    a refusal by one size's graph is the step's."""
    monkeypatch.setattr(step_graph, "SIZES", 2)

    def rows(weight, x, n):  # n: the dynamic size x's rows come with
        return (x[:n] @ weight,)

    weight = torch.randn(8, 4)
    runners = step_graph.StepGraphs(rows)
    # every x kept, so none takes a freed one's address: x is a moving input at every size
    # (an x that sat at one address through warm-up and capture would be taken as static,
    # and its next address would recapture)
    xs = [torch.randn(n, 8) for n in (3, 5, 3, 5, 3, 5, 3, 5, 7, 7)]
    with caplog.at_level(logging.WARNING, logger="gemslib.passes"):
        for x in xs:
            n = x.shape[0]
            torch.testing.assert_close(runners(weight, x, n)[0], x @ weight)
    assert sorted(runners.by_sizes) == [(3,), (5,)] and len(graphs) == 2
    assert all(graph.replays == 2 for graph in graphs)  # its capture's, then one more
    assert "more than 2 sizes" in caplog.text and runners.unsafe is None

    def aliasing(weight, x, n):
        return (x[:n] @ weight, weight.view(-1))

    runners = step_graph.StepGraphs(aliasing)
    for n in (3, 3, 3, 5):
        x = torch.randn(n, 8)
        torch.testing.assert_close(runners(weight, x, n)[0], x @ weight)
    assert "aliases" in runners.unsafe and list(runners.by_sizes) == [(3,)]


@pytest.mark.parametrize("native_module", [True, False])
def test_the_static_inputs_check_is_the_native_one_where_it_is_built(native_module, monkeypatch):
    """A step graph checks its static inputs' addresses on every call: through gemslib's
    native module where it is built, else torch's check; either says whether every listed
    input is still where it was."""
    from gemslib.runtime import native

    built = native.load(native.build()) if native_module else None
    monkeypatch.setattr(native, "module", lambda: built)
    if not hasattr(torch._C, "_tensors_data_ptrs_at_indices_equal"):
        # a CPU build of torch has no check of its own: a stand-in with the CUDA builds'
        # contract (pointers listed by input index, None where an input is not checked)
        def torch_check(tensors, pointers, indices):
            return all(tensors[i].data_ptr() == pointers[i] for i in indices)
        monkeypatch.setattr(torch._C, "_tensors_data_ptrs_at_indices_equal", torch_check,
                            raising=False)
    weight, cache, token = torch.randn(8, 4), torch.zeros(16), torch.ones(1)
    check = step_graph._pointer_check([0, 2], [weight.data_ptr(), cache.data_ptr()])
    assert check((weight, token, cache)) and check([weight, token.clone(), cache])
    assert not check((weight.clone(), token, cache)) and not check((weight, token, cache[1:]))
