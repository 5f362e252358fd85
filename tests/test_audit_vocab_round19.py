"""Audit round 19 of the method contract, the run object and the statistics vocabulary, from a method written from
scratch as a user would (docs/methods.md's recipe: a SearchMethod subclass with a nested Hyperparameters dataclass,
registered with ``@register``): a REINFORCE method over one-hot samples of softmax(θ), with its own θ and baseline.

Defects these tests found (each fails without its fix):

- a ``step`` returning a per-sample loss as ``scalars/train_loss`` (``reduction="none"``: shape (B,)) was recorded
  silently as rows of B numbers under a family whose row is one number (the figures and the DDP mean took it for
  one); a key that is no string stopped the recorder in ``TypeError: expected string or bytes-like object``; a list
  or None was the recorder's ``RecordError`` naming neither the method nor its ``step``; a bool under
  ``scalars/<name>`` (float, mean-reduced) was recorded as such. Each is one `SearchError` line naming the method,
  the path, the vocabulary's family and what to return (`nasdiag.search.base.check_statistics`, run after every
  ``step``: shapes and dtypes only, no host synchronisation).
- a registered method without ``step()`` or ``probabilities()`` was refused only by the base's NotImplementedError at
  the run's first step, the record and its checkpoint written by then; `run` refuses it in one `ConfigError` line
  before anything is written.
- ``run(config, callbacks=[cb])`` with a callback lacking ``on_exception`` ran until the run failed and then replaced
  the failure by its AttributeError (lacking ``on_epoch_end``: the first epoch end); a single callback not in a list
  was a TypeError with the record open. One `ConfigError` line before anything is written.
- such a method (it never calls ``self.cost``) run with diagnostics cost,hessian recorded neither family, silently:
  one warning at the first epoch end.
- ``probabilities()`` of one cell type only derived a genotype silently; a list, numpy arrays or a (K, E) tensor were
  tracebacks of ``genotype()``/``evaluate()``: one `SearchError` line naming the method and ``probabilities()``.

Checked and right: the REINFORCE method through ``run`` (float64, cost and hessian diagnostics) and through the CLI
(``python -c "import mod; from nasdiag.cli import main" search --method ...``), its figures, ``nasdiag plot`` and
``nasdiag report``; an interrupted run resumed to the uninterrupted record and state bit for bit (θ, baseline and the
network), and ``run(SearchConfig.from_dict(meta["config"]...))`` repeated it bit for bit (scratch scripts, ~25 s, not
kept as tests); every path every built-in method's step and diagnostics emit belongs to a family (no undeclared one);
XNAS's, BayesNAS's and SparseNAS's step losses, w_lr and mixing weights (the last test).

Left alone: paths of no family are recorded (docs/schema.md: "any other group/name"), not refused; per-method scalars
(``train_loss``, ``val_loss``, ``w_lr``, ``alpha_grad_norm``) have their meaning in each method's docstring and docs page
rather than a family of their own; `SearchResult` has no timings and keeps ``record`` as given (relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nasdiag.search import Hyperparameters, Schedule, SearchConfig, SearchMethod, hp, register, run
from nasdiag.search.base import SearchError, accuracy
from nasdiag.errors import ConfigError
from nasdiag.supernet import Network


@register("reinforce-r19")
class Reinforce(SearchMethod):
    """REINFORCE on one-hot samples of softmax(θ), SGD on w (a test method)."""

    state_attributes = ("theta", "baseline")  # plain state saved with the method

    @dataclass
    class Hyperparameters(Hyperparameters):
        lr: float = hp(0.1, "Policy-gradient step size of θ.", low=0, low_open=True)
        w_lr: float = hp(0.05, "SGD learning rate of w.", low=0, low_open=True)

    def build(self):
        self.theta = {t: torch.zeros_like(a.detach()) for t, a in self.network.alphas().items()}
        self.baseline = torch.zeros((), dtype=next(self.network.parameters()).dtype)
        self.w_optimizer = torch.optim.SGD(self.network.weight_parameters(), lr=self.hp.w_lr)

    def probabilities(self):
        return {t: torch.softmax(th, -1) for t, th in self.theta.items()}

    def sample(self):
        p = self.probabilities()
        return p, {t: F.one_hot(torch.multinomial(q, 1, generator=self.generator).squeeze(-1), q.shape[-1]).to(q.dtype)
                   for t, q in p.items()}

    def step(self, train_batch, val_batch):
        p, z = self.sample()
        (x, y), (xv, yv) = train_batch, val_batch
        self.w_optimizer.zero_grad(set_to_none=True)
        logits = self.model(x, z)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        self.w_optimizer.step()
        with torch.no_grad():
            val_loss = F.cross_entropy(self.model(xv, z), yv)
            for t in self.theta:  # ∇_θ log p(z) = onehot − softmax(θ)
                self.theta[t] += self.hp.lr * (self.baseline - val_loss) * (z[t] - p[t])
            self.baseline = 0.9 * self.baseline + 0.1 * val_loss
        return {"scalars/train_loss": loss.detach(), "scalars/train_acc": accuracy(logits.detach(), y),
                "scalars/val_loss": val_loss, **self.arch_statistics(z)}


def _method(cls):
    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1).double()
    return cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=3, batch_size=6))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 1, 8, 8, dtype=torch.float64, generator=g), torch.randint(0, 5, (6,), generator=g)


@pytest.mark.parametrize("case", ["per_sample_loss", "key_no_string", "a_list", "bool_scalar", "arch_of_other_shape"])
def test_a_step_returning_statistics_the_vocabulary_does_not_take_is_one_line_naming_the_method(case):
    class Wrong(Reinforce):
        def step(self, train_batch, val_batch):
            stats = Reinforce.step(self, train_batch, val_batch)
            x, y = train_batch
            if case == "per_sample_loss":
                with torch.no_grad():
                    stats["scalars/train_loss"] = F.cross_entropy(self.model(x, self.probabilities()), y, reduction="none")
            elif case == "key_no_string":
                stats[3] = stats["scalars/train_loss"]
            elif case == "a_list":
                return list(stats.values())
            elif case == "bool_scalar":
                stats["scalars/improved"] = stats["scalars/val_loss"] < 1
            else:
                stats["arch/normal/weights"] = stats["arch/normal/weights"][:, :3]
            return stats

    Wrong.name = "wrong-r19"
    method = _method(Wrong)
    _method(Reinforce).step(_batch(), _batch())  # the method as written is taken
    with pytest.raises(SearchError) as err:
        method.step(_batch(), _batch())
    text = str(err.value)
    assert "\n" not in text and text.startswith("wrong-r19: step() must return"), text
    expected = {"per_sample_loss": ("'scalars/train_loss'", "(6,)", "one number"), "key_no_string": ("got 3",),
                "a_list": ("got list",), "bool_scalar": ("'scalars/improved'", "not bool"),
                "arch_of_other_shape": ("'arch/normal/weights'", "(5, 8)", "(5, 3)")}[case]
    assert all(part in text for part in expected), text


def test_a_registered_method_without_step_or_probabilities_is_refused_before_anything_is_written(tmp_path):
    class NoProbabilities(Reinforce):
        probabilities = SearchMethod.probabilities

    register("noprob-r19")(NoProbabilities)
    with pytest.raises(ConfigError) as err:
        run(SearchConfig(method="noprob-r19", epochs=1, C=2, layers=3, steps=2, batch_size=240, diagnostics=(),
                         record=str(tmp_path / "run.h5"), progress=False))
    text = str(err.value)
    assert "\n" not in text and "'noprob-r19'" in text and "probabilities()" in text and "step()" not in text.split(":")[0]
    assert list(tmp_path.iterdir()) == []


class _StepsOnly:  # a user's callback that only reads the rows
    def __init__(self):
        self.steps = []

    def on_step_end(self, step, stats):
        self.steps.append(step)


@pytest.mark.parametrize("callbacks", ["lacks_hooks", "not_a_list"])
def test_a_callback_run_cannot_call_is_refused_before_anything_is_written(callbacks, tmp_path):
    """A callback without on_exception ran until the run failed, then replaced the failure by its AttributeError (an
    interrupt, a NaN loss lost its message); a single callback not in a list was a TypeError once the record was open."""
    given = [_StepsOnly()] if callbacks == "lacks_hooks" else _StepsOnly()
    with pytest.raises(ConfigError) as err:
        run(SearchConfig(method="reinforce-r19", epochs=1, C=2, layers=3, steps=2, batch_size=240, diagnostics=(),
                         record=str(tmp_path / "run.h5"), progress=False), callbacks=given)
    text = str(err.value)
    assert "\n" not in text and "_StepsOnly" in text, text
    assert ("on_epoch_end, on_exception" in text) if callbacks == "lacks_hooks" else ("callbacks=[_StepsOnly(...)]" in text)
    assert list(tmp_path.iterdir()) == []


def test_a_method_that_never_calls_the_cost_service_is_told_its_requested_diagnostics_are_not_recorded(tmp_path):
    """diagnostics=("cost", "hessian") with a method that never calls self.cost(): the record held neither family and
    nothing said so. One warning at the first epoch end, naming the method and the families; the run goes on."""
    config = SearchConfig(method="reinforce-r19", epochs=1, C=2, layers=3, steps=2, batch_size=240,
                          diagnostics=("cost", "hessian"), record=str(tmp_path / "run.h5"), progress=False, threads=1)
    with pytest.warns(UserWarning, match=r"'reinforce-r19' never called self\.cost.*no cost/ statistics and no hessian/"):
        result = run(config)
    from nasdiag.record import load

    rec = load(result.record)
    assert not any(k.startswith(("cost/", "hessian/")) for k in rec)
    assert rec["step"].tolist() == [1, 2] and np.isfinite(rec["scalars/search_val_loss"][-1])


@pytest.mark.parametrize("wrong", ["one_cell_type", "transposed", "a_list", "numpy"])
def test_a_probabilities_return_of_the_wrong_form_is_one_line_at_the_genotype_and_the_evaluation(wrong):
    """probabilities() giving only the normal cell's weights derived a genotype silently (its reduce cell without
    nodes); a list or numpy arrays were AttributeError tracebacks of the genotype and the evaluation, (K, E) torch's
    or the network's ValueError naming no method. One SearchError line naming the method and probabilities()."""
    class Wrong(Reinforce):
        def probabilities(self):
            p = {t: torch.softmax(th, -1) for t, th in self.theta.items()}
            return {"one_cell_type": lambda: {"normal": p["normal"]}, "transposed": lambda: {t: q.T for t, q in p.items()},
                    "a_list": lambda: list(p.values()), "numpy": lambda: {t: q.numpy() for t, q in p.items()}}[wrong]()

    Wrong.name = "wrong-r19"
    method = _method(Wrong)
    for call in (method.genotype, lambda: method.evaluate([_batch()])):
        with pytest.raises(SearchError) as err:
            call()
        text = str(err.value)
        assert "\n" not in text and text.startswith("wrong-r19: probabilities()") and "'reduce': (5, 8)" in text, text
    assert _method(Reinforce).genotype() is not None


@pytest.mark.parametrize("name", ["xnas", "bayesnas", "sparsenas"])
def test_the_step_losses_w_lr_and_mixing_weights_are_the_states_and_batches_their_families_name(name):
    """scalars/train_loss and train_acc: the mean cross-entropy and top-1 accuracy of the search-train batch at the
    weights w before the step, mixed by the Z the w step used (XNAS, BayesNAS: the forward weights before the step;
    SparseNAS, as DARTS: A after its architecture step); XNAS's val_loss: the search-val batch at w after its w step
    (Algorithm 1 lines 4 then 8); w_lr the rate the step used; arch/<cell>/weights that Z and probabilities
    probabilities() after the step. Own float64 cross-entropy and accuracy on copies of the states (all correct)."""
    import copy

    from nasdiag.search import get_method

    cls = get_method(name)
    torch.manual_seed(0)
    net = Network(4, 5, 3, steps=2, multiplier=2, in_channels=1,
                  **({"primitives": cls.primitives} if getattr(cls, "primitives", None) else {})).double()
    method = cls(net, cls.Hyperparameters(), schedule=Schedule(epochs=1, steps_per_epoch=3, batch_size=6))
    train, val = _batch(), (_batch()[0].flip(0), _batch()[1].flip(0))
    for _ in range(2):
        before = copy.deepcopy(method)
        z, active = before.forward_weights(), before.active_ops()
        stats = method.step(train, val)
        if name == "sparsenas":
            z = method.forward_weights()
        kwargs = {} if active is None else {"active": active}
        with torch.no_grad():
            logits = before.network(train[0], z, **kwargs)
            after = copy.deepcopy(before.network)
            after.load_state_dict(method.network.state_dict())
            val_logits = after(val[0], z, **kwargs)
        own = -torch.log_softmax(logits, -1).gather(1, train[1][:, None]).mean()
        assert torch.allclose(stats["scalars/train_loss"], own, rtol=1e-12, atol=0)
        assert float(stats["scalars/train_acc"]) == float((logits.argmax(1) == train[1]).double().mean())
        if name == "xnas":
            own_val = -torch.log_softmax(val_logits, -1).gather(1, val[1][:, None]).mean()
            assert torch.allclose(stats["scalars/val_loss"], own_val, rtol=1e-12, atol=0)
        assert float(stats["scalars/w_lr"]) == before.w_optimizer.param_groups[0]["lr"]
        for t in z:
            assert torch.equal(stats[f"arch/{t}/weights"], z[t]) and torch.equal(stats[f"arch/{t}/probabilities"],
                                                                                  method.probabilities()[t])
