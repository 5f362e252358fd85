"""Structure against numbers: random small compositions of conv/linear (with and without bias), ReLU,
pools and BatchNorm/InstanceNorm/GroupNorm/LayerNorm (affine on and off).

* The scale-invariance flag (wiring supplement Thm. 1, decided from module structure by the one rule
  registry) equals what evaluating f(c·x) = f(x) at a tiny eps says.
* A bias whose effect a following normalization removes (checked numerically: shifting it leaves the
  output unchanged) gets exactly zero curvature from ``diag`` and ``approx``, and ``exact`` agrees to
  round-off; any bias the engine zeroes is such a bias.
"""

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from nasdiag.cost import is_scale_invariant
from nasdiag.hessian import diag_hessian

DT = torch.float64
C, EPS = 3, 1e-14

_conv_layers = st.one_of(
    st.tuples(st.just("conv"), st.booleans(), st.sampled_from([0, 1])),
    st.tuples(st.just("relu")),
    st.tuples(st.just("maxpool")),
    st.tuples(st.just("avgpool"), st.booleans()),
    st.tuples(st.sampled_from(["bn", "in", "gn1", "gnC"]), st.booleans()),
)
_linear_layers = st.one_of(
    st.tuples(st.just("linear"), st.booleans()),
    st.tuples(st.just("relu")),
    st.tuples(st.sampled_from(["bn1d", "ln"]), st.booleans()),
)


# the exact mode's value for a parameter a normalization removes is float64 round-off: its HVP sums terms of
# size ~1 that cancel (seen up to 7e-18); a curvature that is really there is many orders larger
EXACT_ZERO = 1e-14


def _build(spec, conv: bool) -> nn.Sequential:
    layers, pooled = [], False
    for item in spec:
        kind = item[0]
        if kind == "conv":
            layers.append(nn.Conv2d(C, C, 3 if item[2] else 1, padding=item[2], bias=item[1]))
        elif kind == "linear":
            layers.append(nn.Linear(C, C, bias=item[1]))
        elif kind == "relu":
            layers.append(nn.ReLU())
        elif kind == "maxpool" and not pooled:
            layers.append(nn.MaxPool2d(2))
            pooled = True
        elif kind == "avgpool":
            layers.append(nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=item[1]))
        elif kind in ("bn", "bn1d"):
            layers.append((nn.BatchNorm2d if conv else nn.BatchNorm1d)(C, affine=item[1], eps=EPS))
        elif kind == "in":
            layers.append(nn.InstanceNorm2d(C, affine=item[1], eps=EPS))
        elif kind == "gn1":
            layers.append(nn.GroupNorm(1, C, affine=item[1], eps=EPS))
        elif kind == "gnC":
            layers.append(nn.GroupNorm(C, C, affine=item[1], eps=EPS))
        elif kind == "ln":
            layers.append(nn.LayerNorm(C, elementwise_affine=item[1], eps=EPS))
    return nn.Sequential(*layers).to(DT)


def _randomize(net: nn.Sequential) -> None:
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.normal_(1.0 if name.endswith("weight") and p.dim() == 1 else 0.0, 0.5)


@st.composite
def compositions(draw):
    conv = draw(st.booleans())
    spec = draw(st.lists(_conv_layers if conv else _linear_layers, min_size=1, max_size=5))
    return conv, spec, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compositions())
def test_invariance_flag_matches_f_of_scaled_input(case):
    conv, spec, seed = case
    torch.manual_seed(seed)
    net = _build(spec, conv)
    _randomize(net)
    x = torch.randn(*((6, C, 6, 6) if conv else (8, C)), dtype=DT)
    with torch.no_grad():
        out = net(x)
        same = all(torch.allclose(net(c * x), out, rtol=1e-7, atol=1e-7 * (1 + out.abs().max())) for c in (0.3, 3.7))
    assert is_scale_invariant(net) == same, (spec, same)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compositions())
def test_biases_a_normalization_removes_get_exactly_zero_curvature(case):
    conv, spec, seed = case
    torch.manual_seed(seed)
    body = _build(spec, conv)
    _randomize(body)
    head = [nn.Flatten(), nn.LazyLinear(4)] if conv else [nn.Linear(C, 4)]
    x = torch.randn(*((6, C, 6, 6) if conv else (8, C)), dtype=DT)
    net = nn.Sequential(body, nn.Tanh(), *head).to(DT)
    net(x)  # materialize the lazy head
    y = torch.randint(0, 4, (x.shape[0],))
    biases = [n for n, m in net.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear)) and m.bias is not None and n.startswith("0.")]
    if not biases:
        return
    exact = diag_hessian(net, F.cross_entropy, x, y, mode="exact", params=[f"{b}.bias" for b in biases])
    cheap = {m: diag_hessian(net, F.cross_entropy, x, y, mode=m, params=[f"{b}.bias" for b in biases]) for m in ("diag", "approx")}
    with torch.no_grad():
        out = net(x)
        for b in biases:
            bias = net.get_submodule(b).bias
            shift = torch.randn_like(bias)  # a generic shift (a uniform one is removed by more norms, e.g. LayerNorm)
            bias.add_(shift)
            removed = torch.allclose(net(x), out, rtol=1e-10, atol=1e-10)
            bias.sub_(shift)
            name = f"{b}.bias"
            for mode, got in cheap.items():
                zero = bool((got[name] == 0).all())
                assert zero == removed or (not removed and exact[name].abs().max() < EXACT_ZERO), (spec, name, mode)
            if removed:
                assert exact[name].abs().max() < EXACT_ZERO, (spec, name)
