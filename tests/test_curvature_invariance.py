"""Structure against numbers: random small compositions of conv/linear (with and without bias), ReLU,
pools, dropout, flatten (to features, or of the spatial dims only) and BatchNorm/InstanceNorm/GroupNorm/LayerNorm (affine on and off; LayerNorm over
the features, over channel and space, or over the last spatial dim), linear layers on 2-D and on 3-D inputs (where they act on a
spatial dim, not the channel).

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
    st.tuples(st.just("conv"), st.booleans(), st.sampled_from([0, 1, "reflect"])),
    st.tuples(st.just("relu")),
    st.tuples(st.just("maxpool")),
    st.tuples(st.just("avgpool"), st.booleans()),
    st.tuples(st.sampled_from(["dropout", "dropout2d"])),
    st.tuples(st.sampled_from(["bn", "in", "gn1", "gnC", "lnW", "lnCHW"]), st.booleans()),
)
_linear_layers = st.one_of(
    st.tuples(st.just("linear"), st.booleans()),
    st.tuples(st.just("relu")),
    st.tuples(st.sampled_from(["bn1d", "ln"]), st.booleans()),
)


# the exact mode's value for a parameter a normalization removes is float64 round-off: its HVP sums terms of
# size ~1 that cancel (seen up to 7e-18); a curvature that is really there is many orders larger
EXACT_ZERO = 1e-14


#: how a conv composition may end: as it is, or reshaped and normalized once more (Flatten to features ->
#: BatchNorm1d; Flatten(2) of the spatial dims -> BatchNorm1d over the channels, or LayerNorm over the positions)
TAILS = (None, "flatten_bn", "flatten2_bn", "flatten2_ln")


def _build(spec, conv: bool, tail=None) -> nn.Sequential:
    layers, pooled, side = [], False, 6
    for item in spec:
        kind = item[0]
        if kind == "conv":
            reflect = item[2] == "reflect"
            layers.append(nn.Conv2d(C, C, 3 if item[2] else 1, padding=1 if reflect else item[2], bias=item[1],
                                    padding_mode="reflect" if reflect else "zeros"))
        elif kind == "linear":
            layers.append(nn.Linear(C, C, bias=item[1]))
        elif kind == "relu":
            layers.append(nn.ReLU())
        elif kind == "maxpool" and not pooled:
            layers.append(nn.MaxPool2d(2))
            pooled, side = True, side // 2
        elif kind == "dropout":
            layers.append(nn.Dropout(0.3))
        elif kind == "dropout2d":
            layers.append(nn.Dropout2d(0.3))
        elif kind == "lnW":  # LayerNorm over the last spatial dim only
            layers.append(nn.LayerNorm(side, elementwise_affine=item[1], eps=EPS))
        elif kind == "lnCHW":  # LayerNorm over channel and space: one group per sample, like GroupNorm(1, C)
            layers.append(nn.LayerNorm([C, side, side], elementwise_affine=item[1], eps=EPS))
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
    if tail == "flatten_bn":
        layers += [nn.Flatten(), nn.BatchNorm1d(C * side * side, eps=EPS)]
    elif tail == "flatten2_bn":
        layers += [nn.Flatten(2), nn.BatchNorm1d(C, eps=EPS)]
    elif tail == "flatten2_ln":
        layers += [nn.Flatten(2), nn.LayerNorm(side * side, eps=EPS)]
    return nn.Sequential(*layers).to(DT)


def _input(conv: bool, rank3: bool) -> torch.Tensor:
    # a linear layer on a 3-D input (B, C, L) acts on L, a spatial dim of the norms after it
    return torch.randn(*((6, C, 6, 6) if conv else (8, C, C) if rank3 else (8, C)), dtype=DT)


def _same_mask(net, x, seed=0):
    torch.manual_seed(seed)  # train-mode dropout draws its mask from the global generator: one mask for all calls
    return net(x)


def _randomize(net: nn.Sequential) -> None:
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.normal_(1.0 if name.endswith("weight") and p.dim() == 1 else 0.0, 0.5)


@st.composite
def compositions(draw):
    conv = draw(st.booleans())
    spec = draw(st.lists(_conv_layers if conv else _linear_layers, min_size=1, max_size=5))
    shape = draw(st.sampled_from(TAILS) if conv else st.booleans())  # conv: its tail; linear: a 3-D input
    return conv, spec, shape, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compositions())
def test_invariance_flag_matches_f_of_scaled_input(case):
    conv, spec, shape, seed = case
    torch.manual_seed(seed)
    net = _build(spec, conv, tail=shape if conv else None)
    _randomize(net)
    x = _input(conv, rank3=not conv and shape)
    with torch.no_grad():
        out = _same_mask(net, x)
        same = all(torch.allclose(_same_mask(net, c * x), out, rtol=1e-7, atol=1e-7 * (1 + out.abs().max())) for c in (0.3, 3.7))
    assert is_scale_invariant(net, x) == same, (spec, shape, same)
    if is_scale_invariant(net):  # without an example input (ranks unknown) the flag is only ever more cautious
        assert same, (spec, shape)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(compositions())
def test_biases_a_normalization_removes_get_exactly_zero_curvature(case):
    conv, spec, shape, seed = case
    torch.manual_seed(seed)
    # the recursions have no rule for reflect padding, and each call would draw its own dropout mask
    body = _build([item for item in spec if not item[0].startswith("dropout") and item[-1] != "reflect"], conv,
                  tail=shape if conv else None)
    _randomize(body)
    head = [nn.Flatten(), nn.LazyLinear(4)]
    x = _input(conv, rank3=not conv and shape)
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


class _FanOut(nn.Module):
    """conv(bias) read by two BatchNorms whose outputs are added: each removes the bias."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 1)
        self.bn1, self.bn2 = nn.BatchNorm2d(C, eps=EPS), nn.BatchNorm2d(C, eps=EPS)
        self.head = nn.Sequential(nn.Tanh(), nn.Flatten(), nn.Linear(C * 36, 4))

    def forward(self, x):
        y = self.conv(x)
        return self.head(self.bn1(y) + self.bn2(y))


class _SumIn(nn.Module):
    """Two conv(bias) added before one BatchNorm, which removes both biases."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(C, C, 1), nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.c3 = nn.Conv2d(C, C, 1)
        self.bn = nn.BatchNorm2d(C, eps=EPS)
        self.head = nn.Sequential(nn.Tanh(), nn.Flatten(), nn.Linear(C * 36, 4))

    def forward(self, x):
        return self.head(self.bn(self.c1(x) - self.c2(x) + self.c3(x)))


def _bias_curvatures(net, x, params):
    torch.manual_seed(0)
    net(x)
    y = torch.randint(0, 4, (x.shape[0],))
    return {m: diag_hessian(net, F.cross_entropy, x, y, mode=m, params=params) for m in ("exact", "diag", "approx")}


def test_fan_outs_and_sums_before_a_normalization_remove_the_bias():
    x = torch.randn(6, C, 6, 6, dtype=DT)
    for net, names in ((_FanOut(), ["conv.bias"]), (_SumIn(), ["c1.bias", "c3.bias"])):
        torch.manual_seed(1)
        _randomize(net.to(DT))
        got = _bias_curvatures(net, x, names)
        for name in names:
            assert got["exact"][name].abs().max() < EXACT_ZERO
            assert bool((got["diag"][name] == 0).all()) and bool((got["approx"][name] == 0).all()), name


def test_biases_that_survive_a_normalization_keep_their_curvature():
    """A Linear on (B, C, L) acts on L, so its bias varies inside BatchNorm1d's groups; train-mode dropout
    multiplies a bias by its random mask. Neither is removed: the cheap modes must not report zero."""
    linear_3d = nn.Sequential(nn.Linear(C, C), nn.BatchNorm1d(C, eps=EPS), nn.Tanh(), nn.Flatten(), nn.Linear(C * C, 4))
    dropout = nn.Sequential(nn.Conv2d(C, C, 1), nn.Dropout(0.3), nn.BatchNorm2d(C, eps=EPS), nn.Tanh(), nn.Flatten(),
                            nn.Linear(C * 36, 4))
    for net, x in ((linear_3d, torch.randn(8, C, C, dtype=DT)), (dropout, torch.randn(6, C, 6, 6, dtype=DT))):
        torch.manual_seed(1)
        _randomize(net.to(DT))
        assert not is_scale_invariant(net[:3], x) and not is_scale_invariant(net[:3])
        got = _bias_curvatures(net, x, ["0.bias"])
        assert got["exact"]["0.bias"].abs().max() > 1e-6
        assert bool((got["diag"]["0.bias"] != 0).any()) and bool((got["approx"]["0.bias"] != 0).any())


def test_a_nan_batch_gives_nan_for_a_removed_bias_too():
    net = nn.Sequential(nn.Conv2d(C, C, 1), nn.BatchNorm2d(C, eps=EPS), nn.Tanh(), nn.Flatten(), nn.Linear(C * 36, 4)).to(DT)
    x = torch.randn(6, C, 6, 6, dtype=DT)
    x[0, 0, 0, 0] = float("nan")
    for mode in ("diag", "approx"):
        got = diag_hessian(net, F.cross_entropy, x, torch.randint(0, 4, (6,)), mode=mode, params=["0.bias"])
        assert torch.isnan(got["0.bias"]).all(), mode


def _scale_invariant_numerically(net, x) -> bool:
    with torch.no_grad():
        out = _same_mask(net, x)
        return all(torch.allclose(_same_mask(net, c * x), out, rtol=1e-7, atol=1e-7) for c in (0.3, 3.7))


def test_flags_that_need_the_input_rank_or_a_vacuous_axis():
    """Invariant, and flagged so given an example input: a conv bias under LayerNorm over the last spatial
    dim, under Flatten -> BatchNorm1d (no spatial dim left), or before a reflect-padded conv into BatchNorm."""
    x = torch.randn(6, C, 6, 6, dtype=DT)
    nets = [
        nn.Sequential(nn.Conv2d(C, C, 1), nn.LayerNorm(6, eps=EPS)),
        nn.Sequential(nn.Conv2d(C, C, 1), nn.AvgPool2d(3, 1, 1), nn.Flatten(), nn.BatchNorm1d(C * 36, eps=EPS)),
        nn.Sequential(nn.Conv2d(C, C, 1), nn.Conv2d(C, C, 3, padding=1, padding_mode="reflect"), nn.BatchNorm2d(C, eps=EPS)),
        nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6, eps=EPS)),
    ]
    for net in nets:
        torch.manual_seed(2)
        _randomize(net.to(DT))
        inp = x if isinstance(net[0], nn.Conv2d) else torch.randn(8, 6, dtype=DT)
        assert _scale_invariant_numerically(net, inp), net
        assert is_scale_invariant(net, inp), net


# A normalization that does not remove a bias still divides by statistics that depend on it: what comes out is a
# positive factor (one per sample for GroupNorm(1, C)) times a fixed function of the input, plus a term. A later
# normalization with per-sample groups that removes the term removes the factor too, so the bias has no effect
# and the op is scale-invariant (f(c x) = f(x)), through an unpadded convolution, a pool or a reshape in between
# as well (not through a ReLU: relu(a y + o) is not a ⊙ relu(y) plus a term).
_PER_SAMPLE_AFTER_GN1 = [
    ([], nn.InstanceNorm2d(C, eps=EPS)),
    ([], nn.GroupNorm(C, C, eps=EPS)),
    ([], nn.LayerNorm(6, eps=EPS)),
    ([nn.Conv2d(C, C, 3, bias=False)], nn.InstanceNorm2d(C, affine=True, eps=EPS)),  # unpadded: the term stays constant
    ([nn.MaxPool2d(2)], nn.InstanceNorm2d(C, eps=EPS)),
    ([nn.Flatten(2)], nn.LayerNorm(36, eps=EPS)),
]


def test_a_bias_a_first_normalization_keeps_is_removed_by_a_second_per_sample_one():
    x = torch.randn(6, C, 6, 6, dtype=DT)
    for between, second in _PER_SAMPLE_AFTER_GN1:
        body = nn.Sequential(nn.Conv2d(C, C, 1), nn.GroupNorm(1, C, eps=EPS), *between, second).to(DT)
        torch.manual_seed(2)
        _randomize(body)
        with torch.no_grad():
            assert torch.allclose(body(3.7 * x), body(x), atol=1e-9)  # invariant, numerically
        assert is_scale_invariant(body, x), between
        net = nn.Sequential(body, nn.Tanh(), nn.Flatten(), nn.LazyLinear(4)).to(DT)
        got = _bias_curvatures(net, x, ["0.0.bias", "0.0.weight"])
        # the first normalization's eps (1e-14 against a variance of order 1) leaves ~1e-14 here
        assert got["exact"]["0.0.bias"].abs().max() < 1e-10 * got["exact"]["0.0.weight"].abs().max()
        assert (got["diag"]["0.0.bias"] == 0).all() and (got["approx"]["0.0.bias"] == 0).all(), between


def test_a_factor_one_batch_norm_leaves_is_not_divided_out_by_per_sample_norms():
    # BatchNorm's factor is one per channel and GroupNorm(1, C) mixes channels: neither the flag nor the zero
    # may claim invariance here (a Linear over space keeps the bias from BatchNorm's removal)
    body = nn.Sequential(nn.Conv2d(C, C, 1), nn.GroupNorm(1, C, eps=EPS), nn.BatchNorm2d(C, eps=EPS), nn.GroupNorm(1, C, eps=EPS)).to(DT)
    x = torch.randn(6, C, 6, 6, dtype=DT)
    torch.manual_seed(3)
    _randomize(body)
    with torch.no_grad():
        assert not torch.allclose(body(3.7 * x), body(x), atol=1e-6)
    assert not is_scale_invariant(body, x)
