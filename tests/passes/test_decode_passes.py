"""The decode_gemv rewrite (gemslib.passes.decode): a static-cache decode step's projections
take the norms before them, the gated activation before the down projection and the residual
add after them (decode_gemv's prologues and epilogue), only where it is switched on and only
at sites it computes exactly; every result stays eager's."""

import re
from collections import Counter

import pytest
import torch

import gemslib
from helpers import DEVICE
from gemslib.fused import decode_gemv as gemv_ops
from gemslib.passes.forms import transformers_rms_norm

transformers = pytest.importorskip("transformers")

from benchmark import decode, realmodels  # noqa: E402  (needs transformers)
from gemslib.models import MODELS, build_model  # noqa: E402

ON = "GEMSLIB_DECODE_GEMV"


@pytest.fixture
def folds_up_to_16_rows(monkeypatch):
    """The rewrite's sites at every row count the kernel takes (it folds one row by default,
    the measured case: ``FOLD_ROWS``), so that the forms are checked at 2-16 rows too."""
    from gemslib.passes import decode as decode_passes

    monkeypatch.setattr(decode_passes, "FOLD_ROWS", gemv_ops.MAX_ROWS)
# the gemslib ops whose launches the rewrite folds into the projections
FOLDED = ("rms_norm_forward", "add_rms_norm", "silu_and_mul", "gelu_and_mul")


def _tiny(name):
    """The family's tiny config (2 layers, hidden 64, intermediate 128) in fp32, its norm
    weights away from their identity and its biases away from 0, so that a dropped weight or
    bias shows."""
    spec = MODELS[name].tiny()
    model = build_model(spec, DEVICE, torch.float32)
    torch.manual_seed(1)
    for parameter_name, parameter in model.named_parameters():
        if "norm" in parameter_name:
            parameter.data.uniform_(0.5, 1.5)
        elif parameter_name.endswith("bias"):
            parameter.data.uniform_(-0.5, 0.5)
    return spec, model


def _calls(code: str) -> Counter:
    """gemslib op -> its calls in inductor's generated code."""
    return Counter(re.findall(r"= torch\.ops\.gemslib\.(\w+)\.(?:graph|default)\(", code))


def _step_and_eager(name, batch, prompt=12, cache_len=16):
    """(the logits of the static-cache decode step compiled as benchmark.decode compiles it
    (backend gemslib, mode reduce-overhead), inductor's code, eager's logits of the same step
    over a dynamic cache, the model's layers)."""
    from torch._inductor.utils import run_and_get_code

    spec, model = _tiny(name)
    ids = realmodels.input_ids(spec, batch, prompt, DEVICE)
    with torch.no_grad():
        expected = decode._step_runner("eager", model, ids, cache_len)[0]()
        step, _ = decode._step_runner("static-gemslib", model, ids, cache_len)
        logits, codes = run_and_get_code(step)
    return logits, "\n".join(codes), expected, spec.layers


def _assert_logits_close(got, expected):
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    assert error <= 1e-5, f"max error {error:.2e} of the largest logit"


# (model, batch): q/k/v and gate/up merged (llama, mistral), with q/k/v biases (qwen2), with
# per-head q/k norms in the rotary's launch (qwen3), one qkv_proj and one gate_up_proj weight
# (phi3), GELU-tanh and (1 + w) norms (gemma); batches of 1 (the one-row GEMV) to 16 rows
# (folded at more than one row only under the fixture)
_FAMILIES = [("llama3-8b", 1), ("mistral-7b", 16), ("qwen2-7b", 3), ("qwen3-8b", 1),
             ("phi3-mini", 2), ("gemma-7b", 1)]


@pytest.mark.parametrize("name, batch", _FAMILIES)
def test_a_decode_step_s_projections_take_the_small_ops_around_them(name, batch,
                                                                     folds_up_to_16_rows,
                                                                     monkeypatch):
    """With GEMSLIB_DECODE_GEMV=1, each layer's three small launches (the activation before
    the down projection, the add_rms_norm after the o projection, the add_rms_norm after the
    down projection: the next layer's input norm, or the last layer's final norm before the
    lm_head) are folded into the projections, and so is the first layer's rms_norm: 3 sites a
    layer + 1, counted from the forms the other fusions report (2 add_rms_norm a layer, one
    gated activation a layer, the first rms_norm). Each layer's rotary and cache write go
    into its q/k/v GEMV (decode_gemv_rotary, one site a layer; not Qwen3's, whose per-head q/k
    norms stay in rotary_into_cache's launch). A layer then runs five gemslib launches (q/k/v GEMV with the norm, the rotary and
    the cache write; decode attention; o GEMV with the residual; gate/up GEMV with the norm;
    down GEMV with the gated prologue and the residual), the lm_head one more; the logits are
    eager's. With ``gemslib.decode_gemv_rotary`` off, the rotary keeps its own launch."""
    from torch._inductor.fx_passes.reinplace import ReinplaceCounters

    monkeypatch.setenv(ON, "1")
    ReinplaceCounters.clear()
    logits, code, expected, layers = _step_and_eager(name, batch)
    report = gemslib.fusion_report()
    gated = "gelu_and_mul" if name.startswith("gemma") else "silu_and_mul"
    assert report["add_rms_norm"] == 2 * layers and report[gated] == layers and \
        report["rotary_into_cache"] == layers, report
    assert report["decode_gemv"] == report["add_rms_norm"] + report[gated] + 1 == \
        3 * layers + 1, report
    calls = _calls(code)
    assert not any(calls[op] for op in FOLDED), calls
    if name.startswith("qwen3"):
        assert "decode_gemv_rotary" not in report and calls["rotary_into_cache"] == layers
        assert calls["decode_gemv"] + calls["decode_gemv_merged"] == 4 * layers + 1, calls
        assert sum(calls.values()) == 6 * layers + 1, calls
        # its per-head norms' weights in it: (..., k_cache, v_cache, q_weight, k_weight, eps
        assert len(re.findall(r"rotary_into_cache\.graph\(.*, (arg\d+_1, ){4}1e-06", code)) == \
            layers
    else:
        assert report["decode_gemv_rotary"] == layers, report
        assert calls["decode_gemv"] + calls["decode_gemv_merged"] == 3 * layers + 1, calls
        assert calls["decode_gemv_rotary"] == layers and not calls["rotary_into_cache"], calls
        assert sum(calls.values()) == 5 * layers + 1, calls
        # each launch writes the graph's cache inputs themselves: no copy of a cache
        written = re.findall(r"decode_gemv_rotary\.graph\([^\n]*, (?:False|True), \w+, "
                             r"(arg\d+_1), (arg\d+_1), \d+", code)
        assert len(set(written)) == layers, code
    assert ReinplaceCounters.get_total_missed_bytes() == 0
    # decode_gemv_rotary(x, weights, biases, norm_weight, eps, weight_offset, ...): its norm's
    # offset, and Qwen3's per-head norm weights after n_q_heads
    rotary_calls = re.findall(r"decode_gemv_rotary\.graph\(\w+, \[[^]]*\], \[[^]]*\], "
                              r"arg\d+_1, [^,]+, ([^,]+), (.*)\)\n", code)
    assert len(rotary_calls) == report.get("decode_gemv_rotary", 0), code
    if name.startswith("gemma"):  # the GELU's tanh form and the (1 + w) norms carried over
        assert len(re.findall(rf", {gemv_ops.ACTIVATIONS['gelu_tanh']}\)\n", code)) == layers
        assert len(re.findall(r", 1\.0, -1\)\n", code)) == layers + 1
        assert all(offset == "1.0" for offset, _ in rotary_calls), rotary_calls
    _assert_logits_close(logits, expected)


def test_the_rotary_s_own_option_keeps_its_launch(monkeypatch):
    """GEMSLIB_DECODE_GEMV_ROTARY=0: the q/k/v GEMV takes its norm, rotary_into_cache stays a
    launch of its own (six a layer); the logits are eager's."""
    monkeypatch.setenv(ON, "1")
    monkeypatch.setenv("GEMSLIB_DECODE_GEMV_ROTARY", "0")
    logits, code, expected, layers = _step_and_eager("qwen2-7b", 1)
    report = gemslib.fusion_report()
    assert "decode_gemv_rotary" not in report and report["decode_gemv"] == 3 * layers + 1, report
    calls = _calls(code)
    assert calls["rotary_into_cache"] == layers and not calls["decode_gemv_rotary"], calls
    assert sum(calls.values()) == 6 * layers + 1, calls
    _assert_logits_close(logits, expected)


def test_a_step_of_more_than_one_row_keeps_its_launches_by_default(monkeypatch):
    """FOLD_ROWS (one row): a B3 step is left as it is, right."""
    monkeypatch.setenv(ON, "1")
    logits, code, expected, layers = _step_and_eager("llama3-8b", 3)
    report = gemslib.fusion_report()
    assert "decode_gemv" not in report and "decode_gemv_rotary" not in report, report
    calls = _calls(code)
    assert calls["add_rms_norm"] == 2 * layers and calls["rotary_into_cache"] == layers, calls
    _assert_logits_close(logits, expected)


def test_the_option_switches_it_on_and_by_default_it_is_off_without_a_verdict(monkeypatch):
    """By default (no decode_gemv verdict in the tune config; the suite sets verdicts aside)
    no decode_gemv site, the norms and the activation launched as before;
    ``options={"gemslib.decode_gemv": True}`` turns it on without the variable, the variable
    set turns it on unless the option says False; the results are eager's either way."""
    monkeypatch.delenv(ON, raising=False)
    logits, code, expected, layers = _step_and_eager("llama3-8b", 2)
    assert "decode_gemv" not in gemslib.fusion_report(), gemslib.fusion_report()
    calls = _calls(code)
    assert calls["add_rms_norm"] == 2 * layers and calls["silu_and_mul"] == layers, calls
    _assert_logits_close(logits, expected)

    spec, model = _tiny("llama3-8b")
    ids = torch.randint(0, spec.vocab, (1, 1), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits
        for options, sites in (({"gemslib.decode_gemv": True}, 3 * spec.layers + 1),
                               (None, 0)):
            # a prefill of one token is a decode_gemv site too
            _assert_logits_close(_one_token(model, ids, options, sites), expected)
        monkeypatch.setenv(ON, "1")
        _one_token(model, ids, {"gemslib.decode_gemv": False}, 0)


def _one_token(model, ids, options, sites):
    """The logits of ``model`` compiled by gemslib with ``options`` on one token, after
    checking that the compile folded ``sites`` decode_gemv sites."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    got = torch.compile(model, backend="gemslib", fullgraph=True, options=options)(ids).logits
    assert gemslib.fusion_report().get("decode_gemv", 0) == sites, gemslib.fusion_report()
    return got


_DECODE_GEMV_VERDICTS = """
schema: 1
device: test
ops: {{}}
verdicts:
  decode_gemv:
    - max: {{rows: 1, cols: {cols}}}
      use: {narrow}
    - use: {wide}
"""


@pytest.mark.parametrize("narrow, wide", [("gemslib", "gemslib"), ("inductor", "inductor"),
                                          ("inductor", "gemslib")])
def test_by_default_it_folds_where_the_tune_config_measured_it_faster(config_file,
                                                                      monkeypatch, narrow,
                                                                      wide):
    """Its default is "measured": a site is folded where the file's decode_gemv verdict
    for its main input (the rows its first projection reads) says gemslib, left where it says
    inductor; switched on, the verdict still decides where it has one."""
    monkeypatch.delenv(ON, raising=False)
    spec, model = _tiny("llama3-8b")
    config_file(_DECODE_GEMV_VERDICTS.format(cols=spec.hidden, narrow=narrow, wide=wide))
    ids = torch.randint(0, spec.vocab, (1, 1), device=DEVICE)
    # a site's rows: the first norm's, and the residual add + norm after the o projection
    # (keyed on o's input), of the hidden width; the gated down projection's, and the residual
    # add + norm after it (keyed on its input), of the intermediate's, wider
    sites = {"gemslib": spec.layers + 1, "inductor": 0}[narrow] + \
        {"gemslib": 2 * spec.layers, "inductor": 0}[wide]
    with torch.no_grad():
        expected = model(ids).logits
        for options in (None, {"gemslib.decode_gemv": True}):
            _assert_logits_close(_one_token(model, ids, options, sites), expected)
        _one_token(model, ids, {"gemslib.decode_gemv": False}, 0)


@pytest.mark.parametrize("batch, prompt, step", [(32, 12, True), (2, 12, False)],
                         ids=["B32 decode step", "24-row prefill"])
def test_more_than_16_rows_are_left_alone(batch, prompt, step, folds_up_to_16_rows,
                                          monkeypatch):
    monkeypatch.setenv(ON, "1")
    if step:
        logits, code, expected, _ = _step_and_eager("llama3-8b", batch, prompt)
    else:
        spec, model = _tiny("llama3-8b")
        ids = realmodels.input_ids(spec, batch, prompt, DEVICE)
        torch._dynamo.reset()
        gemslib.reset_fusion_report()
        with torch.no_grad():
            expected = model(ids).logits
            logits = torch.compile(model, backend="gemslib", fullgraph=True)(ids).logits
    report = gemslib.fusion_report()
    assert "decode_gemv" not in report and report["add_rms_norm"] == 4, report
    _assert_logits_close(logits, expected)


class _DecodeForms(torch.nn.Module):
    """A decode layer's forms beside look-alikes, each over its own weights and its own input
    (``h + i``: projections of one input would merge across the forms): ``forward(h,
    residual)`` returns every form's outputs (the second output of a pair is a value the
    form's graph reads again, which the rewrite must keep)."""

    def __init__(self, width=32, inner=48, rows_bias=True):
        super().__init__()
        torch.manual_seed(0)

        def linear(n_in, n_out, bias=False):
            return torch.nn.Linear(n_in, n_out, bias=bias)

        def norm_weight():
            return torch.nn.Parameter(torch.rand(width) + 0.5)

        self.width = width
        # the whole form: o projection, residual add + norm, gate/up, silu * up, down + residual
        self.o, self.g = linear(width, width, bias=rows_bias), norm_weight()
        self.gate, self.up, self.down = linear(width, inner), linear(width, inner), \
            linear(inner, width)
        # look-alikes
        self.o2, self.g2, self.q2 = linear(width, width), norm_weight(), linear(width, width)
        self.o3, self.g3, self.q3 = linear(width, width), norm_weight(), linear(width, width)
        self.gate4, self.up4, self.down4 = linear(width, inner), linear(width, inner), \
            linear(inner, width)
        self.o5, self.g5, self.q5 = linear(width, width), norm_weight(), linear(width, width)
        self.scale5 = torch.nn.Parameter(torch.rand(width, 1) + 0.5)

    def forward(self, h, residual):
        eps = 1e-6
        total = residual + self.o(h)
        normed = transformers_rms_norm(total, self.g, eps)
        act = torch.nn.functional.silu(self.gate(normed)) * self.up(normed)
        layer = total + self.down(act)
        # the normalised rows read by something else than a projection: left alone
        total2 = residual + self.o2(h + 2)
        normed2 = transformers_rms_norm(total2, self.g2, eps)
        read_again = (self.q2(normed2), normed2 * 2)
        # the projection before the add read by something else: left alone
        projected3 = self.o3(h + 3)
        normed3 = transformers_rms_norm(residual + projected3, self.g3, eps)
        output_read = (self.q3(normed3), projected3)
        # the gated activation read by something else: left alone
        act4 = torch.nn.functional.silu(self.gate4(h + 4)) * self.up4(h + 4)
        gated_read = (self.down4(act4), act4 + 1)
        # a weight that is not a graph input (computed in the graph): left alone
        total5 = residual + self.o5(h + 5)
        normed5 = transformers_rms_norm(total5, self.g5, eps)
        not_a_parameter = (torch.nn.functional.linear(normed5, self.q5.weight * self.scale5),
                           total5)
        return layer, read_again, output_read, gated_read, not_a_parameter


@pytest.fixture(params=["addmm", "mm + bias"])
def biased_linear_form(request, monkeypatch):
    """Both forms a biased linear layer reaches the passes in: ``addmm``, or (as inductor
    leaves it on a GPU where only pointwise ops read it) ``mm`` with the bias added after."""
    from torch._inductor.fx_passes import post_grad

    check = post_grad.should_prefer_unfused_addmm
    code = check.__code__
    if request.param == "mm + bias":
        def on_any_device(match):
            return all(is_pointwise_use(use) for use in match.output_node().users)  # noqa: F821
        check.__code__ = on_any_device.__code__
    try:
        yield request.param
    finally:
        check.__code__ = code


@pytest.mark.parametrize("rows", [1, 5])
def test_look_alikes_are_left_alone_and_right(rows, biased_linear_form, folds_up_to_16_rows,
                                              monkeypatch):
    """Only the whole form fuses (its activation, and its add_rms_norm with the o projection
    before it and the gate/up projections after it): 2 sites; every look-alike keeps its
    launches, and every output stays eager's. The o projection has a bias: an addmm, or an
    mm and an add (the residual then takes the bias along)."""
    monkeypatch.setenv(ON, "1")
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _DecodeForms().to(DEVICE).eval()
    h, residual = (torch.randn(rows, 1, module.width, device=DEVICE) for _ in range(2))
    with torch.no_grad():
        expected = module(h, residual)
        got = torch.compile(module, backend="gemslib", fullgraph=True)(h, residual)
    report = gemslib.fusion_report()
    assert report["decode_gemv"] == 2 and report["add_rms_norm"] == 4, report
    for ours, eager in zip(torch.utils._pytree.tree_leaves(got),
                           torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)


def test_a_training_graph_and_symbolic_rows_are_left_alone(folds_up_to_16_rows, monkeypatch):
    """With gradients (a training compile: the intermediates are saved for the backward) and
    with a symbolic number of rows (``dynamic=True``) the rewrite makes nothing; the
    gradients and outputs stay eager's."""
    monkeypatch.setenv(ON, "1")
    module = _DecodeForms().to(DEVICE)
    h, residual = (torch.randn(2, 1, module.width, device=DEVICE) for _ in range(2))
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    compiled = torch.compile(module, backend="gemslib")
    loss = compiled(h, residual)[0].square().sum()
    grads = torch.autograd.grad(loss, list(module.parameters()), allow_unused=True)
    expected = torch.autograd.grad(module(h, residual)[0].square().sum(),
                                   list(module.parameters()), allow_unused=True)
    assert "decode_gemv" not in gemslib.fusion_report(), gemslib.fusion_report()
    for ours, eager in zip(grads, expected):
        if eager is not None:
            torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-5)

    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    with torch.no_grad():
        got = torch.compile(module, backend="gemslib", dynamic=True)(h, residual)[0]
        torch.testing.assert_close(got, module(h, residual)[0], rtol=1e-5, atol=1e-5)
    assert "decode_gemv" not in gemslib.fusion_report(), gemslib.fusion_report()
