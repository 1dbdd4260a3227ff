"""The in-memory API gives what the mergekit path gives, with global rho, through mergekit's own function."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from mergekit.merge_methods import merge_state_dicts as mergekit_merge_state_dicts

from mergekit_ram import ParameterError, merge_state_dicts
from tests import reference
from tests.conftest import Merged, ModelSet, load_statistics, load_weights, merge_in_process


@pytest.fixture(params=["ram", "ram_plus"])
def yaml_merge(request: pytest.FixtureRequest) -> tuple[str, str]:
    """The shared mergekit-yaml merge of ``bf16_models.recipe(method)`` for each method (conftest.py)."""
    method = request.param
    merged: Merged = request.getfixturevalue({"ram": "ram_merge", "ram_plus": "ram_plus_merge"}[method])
    return method, merged.out


def models_of(bf16_models: ModelSet) -> dict[str, dict[str, torch.Tensor]]:
    return {"base": load_weights(bf16_models.base), **{path: load_weights(path) for path in bf16_models.agents}}


def test_state_dicts_merge_like_mergekit_yaml(bf16_models: ModelSet, yaml_merge: tuple[str, str]) -> None:
    """Ours, mergekit's public merge_state_dicts, and the 0.1 call shape: the files mergekit-yaml wrote."""
    method, out = yaml_merge
    models = models_of(bf16_models)
    merged, statistics = merge_state_dicts(models, method, base="base")
    expected = load_weights(out)
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        assert merged[name].dtype == torch.bfloat16
        assert torch.equal(merged[name], tensor), name
    from_disk = load_statistics(out)["models"]
    assert [s.lambda_ for s in statistics.models] == [m["lambda"] for m in from_disk]
    assert [s.shared for s in statistics.models] == [m["shared"] for m in from_disk]
    assert statistics.source == ("pre-pass" if method == "ram_plus" else "merge")
    # mergekit's own function merges one group at a time: ram as is; ram_plus with the lambdas pinned, and
    # refused in one line without them (nothing counts the global rho there)
    pins = {"lambda": {model: stats.lambda_ for model, stats in zip(bf16_models.agents, statistics.models)}}
    theirs = mergekit_merge_state_dicts(models, method, base="base", parameters=pins if method == "ram_plus" else {})
    assert all(torch.equal(theirs[name], tensor) for name, tensor in expected.items())
    if method == "ram_plus":
        with pytest.raises(ParameterError, match=r"needs the global rho, .* mergekit_ram.merge_state_dicts, or pin"):
            mergekit_merge_state_dicts(models, method, base="base")


def test_soft_rule_and_out_dtype_round_once(bf16_models: ModelSet) -> None:
    """out_dtype=float32 on bfloat16 inputs: the float32 result itself, not a bfloat16 one cast up."""
    models = models_of(bf16_models)
    merged, statistics = merge_state_dicts(
        models, "ram_plus", base="base", parameters={"rule": "soft", "r": 0.2}, out_dtype=torch.float32
    )
    for model in statistics.models:
        assert model.lambda_ == reference.lambda_soft(reference.rho(model.shared, model.unique), 0.2)
    lambdas = [model.lambda_ for model in statistics.models]
    finetunes = [models[path] for path in bf16_models.agents]
    rounded_twice = 0
    for name, tensor in models["base"].items():
        expected = reference.merge(tensor, [ft[name] for ft in finetunes], 1e-5, lambdas)
        assert merged[name].dtype == torch.float32
        assert torch.equal(merged[name], expected), name
        rounded_twice += int((expected.to(torch.bfloat16).float() != expected).sum())
    # The case matters: a bfloat16 result would differ in these elements (fixed seeds: a constant, measured once).
    assert rounded_twice == 11829


def test_one_step_values_round_once() -> None:
    """Base 1, A = 1 + 2**-7, B = 1 + 2**-6 in bfloat16: 1.01171875 in float32 and float16."""
    models = {
        "base": {"w": torch.ones(2, dtype=torch.bfloat16)},
        "a": {"w": torch.tensor([1 + 2**-7, 1.0], dtype=torch.bfloat16)},
        "b": {"w": torch.tensor([1 + 2**-6, 1.0], dtype=torch.bfloat16)},
    }
    for out_dtype in (torch.float32, torch.float16):
        for method in ("ram", "ram_plus"):
            merged, _ = merge_state_dicts(models, method, base="base", out_dtype=out_dtype)
            assert merged["w"].dtype == out_dtype
            assert merged["w"].tolist() == [1.01171875, 1.0]
    assert merge_state_dicts(models, "ram", base="base")[0]["w"].tolist() == [1.015625, 1.0]  # bfloat16


def test_float64_state_dicts_stay_exact() -> None:
    base = torch.full((4, 5), 1.000000000001, dtype=torch.float64)
    a, b = base.clone(), base.clone()
    a[0] = 1.5
    b[1, :2] = 0.25
    merged, statistics = merge_state_dicts({"base": {"w": base}, "a": {"w": a}, "b": {"w": b}}, "ram_plus", base="base")
    assert merged["w"].dtype == torch.float64
    assert merged["w"][2:].tolist() == base[2:].tolist()
    assert merged["w"][2, 0].item() == 1.000000000001
    lambdas = [model.lambda_ for model in statistics.models]
    assert torch.equal(merged["w"], reference.merge(base, [a, b], 1e-5, lambdas))
    assert (
        merge_state_dicts(
            {"base": {"w": base}, "a": {"w": a}, "b": {"w": b}}, "ram_plus", base="base", dtype=torch.float32
        )[0]["w"][2, 0].item()
        == 1.0
    )  # asking for float32 inputs is honoured


def test_module_parameters_keep_autograd_history() -> None:
    """mergekit's README shape: nn.Modules whose parameters require grad; values as without grad."""
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 4)
    modules = {"base": base, "a": copy.deepcopy(base), "b": copy.deepcopy(base)}
    with torch.no_grad():
        modules["a"].weight[:2] += 0.5
        modules["b"].weight[1:3] -= 0.25
    merged, _ = merge_state_dicts(modules, "ram_plus", base="base")
    assert merged["weight"].grad_fn is not None
    with torch.no_grad():
        plain, statistics = merge_state_dicts(modules, "ram_plus", base="base")
    assert plain["weight"].grad_fn is None
    assert all(torch.equal(merged[name].detach(), plain[name]) for name in plain)
    merged["weight"].sum().backward()
    # a and b: 6 shared (row 1), 6 unique elements each -> rho 1, lambda 1 + 0.1 * 1 = 1.1
    assert [model.lambda_ for model in statistics.models] == [1.1, 1.1]
    # d merged / d a: lambda_a on row 0 (a alone), 1/2 on row 1 (both); d / d base: 1 - sum of those
    assert modules["a"].weight.grad[:, 0].tolist() == pytest.approx([1.1, 0.5, 0.0, 0.0])
    assert modules["b"].weight.grad[:, 0].tolist() == pytest.approx([0.0, 0.5, 1.1, 0.0])
    assert modules["base"].weight.grad[:, 0].tolist() == pytest.approx([-0.1, 0.0, -0.1, 1.0])
    assert modules["base"].bias.grad is None  # only the weight's result was used


def test_float16_cast_overflow_names_the_cast() -> None:
    models = {
        "base": {"w": torch.tensor([70000.0, 1.0], dtype=torch.bfloat16)},
        "agent": {"w": torch.tensor([70000.0, 2.0], dtype=torch.bfloat16)},
    }
    with pytest.raises(
        ValueError, match=r"base: tensor w is Inf after the cast from bfloat16 to float16 \(dtype\); values above 65504"
    ):
        merge_state_dicts(models, "ram", base="base", dtype=torch.float16)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        # within float32, but lambda times the update (4.0) is not: the kernel names the tensor and the fix
        ({"lambda": {"a": 3e38, "b": None}}, r"ram_plus: tensor w: the merged values overflow float32; merge with"),
        ({"r": 1e38}, r"ram_plus: tensor w: the merged values overflow float32; merge with `dtype: float64`"),
        # beyond float32: refused with the arguments, before any tensor is read
        (
            {"lambda": {"a": 1e300, "b": None}},
            r"ram_plus: parameter 'lambda' in .* is 1e\+300, above the largest float32",
        ),
        ({"r": 1e300}, r"ram_plus: parameter 'r' in .* is 1e\+300, above the largest float32"),
    ],
)
def test_overflowing_lambda_is_an_error_naming_the_parameter(parameters: dict, message: str) -> None:
    models = {
        "base": {"w": torch.zeros(4)},
        "a": {"w": torch.tensor([4.0, 0.0, 0.25, 0.0])},
        "b": {"w": torch.tensor([0.0, 0.5, 0.25, 0.0])},
    }
    with pytest.raises(ParameterError, match=message):
        merge_state_dicts(models, "ram_plus", base="base", parameters=parameters)


@pytest.mark.parametrize("method", ["ram", "ram_plus", "ram_ties", "ram_unique"])
def test_an_overflowing_update_is_named_with_its_fix(method: str) -> None:
    """a's update (3e38 - (-3e38)) overflows float32 itself (ram_ties: before its trim): the line names the tensor
    and the fix; the float64 merge it points to gives the exact result."""
    models = {
        "base": {"w": torch.tensor([-3e38, 0.0, 1.0, 0.0])},
        "a": {"w": torch.tensor([3e38, 0.5, 1.0, 0.0])},
        "b": {"w": torch.tensor([-3e38, 0.5, 1.5, 0.0])},
    }
    with pytest.raises(ParameterError) as error:
        merge_state_dicts(models, method, base="base")
    assert str(error.value) == (
        f"{method}: tensor w: the update of a (its value minus the base's) overflows float32; merge with "
        "`dtype: float64` (arithmetic is then float64)"
    )
    merged, statistics = merge_state_dicts(models, method, base="base", dtype=torch.float64)
    lam = statistics.models[0].lambda_  # a changed [0] alone
    assert merged["w"][0].item() == pytest.approx(-3e38 + lam * 6e38)


def test_mismatched_inputs_name_model_and_tensor(bf16_models: ModelSet) -> None:
    base = load_weights(bf16_models.base)
    broken = dict(base)
    broken["model.norm.weight"] = torch.ones(7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"agent: tensor model.norm.weight has shape \(7,\); the base's is \(32,\)"):
        merge_state_dicts({"base": base, "agent": broken}, "ram_plus", base="base")
    poisoned = dict(base)
    poisoned["lm_head.weight"] = base["lm_head.weight"].clone()
    poisoned["lm_head.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="agent: tensor lm_head.weight contains NaN or Inf"):
        merge_state_dicts({"base": base, "agent": poisoned, "other": base}, "ram_plus", base="base")
    with pytest.raises(ParameterError, match="`base` must name the base model"):
        merge_state_dicts({"base": base, "agent": base}, "ram")


WRONG_MODELS = [
    (5, "ram: `models` must be a mapping of names to state dicts (or torch.nn.Module), or a list of them; got int"),
    (
        "base",
        "ram: `models` must be a mapping of names to state dicts (or torch.nn.Module), or a list of them; got str",
    ),
    (
        {"base": {"w": torch.zeros(2)}, "agent": [torch.ones(2)]},
        "ram: model 'agent' must be a state dict (a mapping of tensor names to tensors) or a torch.nn.Module; got list",
    ),
    (
        [{"w": torch.zeros(2)}, 3],
        "ram: model 1 must be a state dict (a mapping of tensor names to tensors) or a torch.nn.Module; got int",
    ),
]


@pytest.mark.parametrize(("models", "message"), WRONG_MODELS)
def test_models_of_another_kind_are_one_line_naming_the_argument(models: Any, message: str) -> None:
    with pytest.raises(ParameterError) as refused:
        merge_state_dicts(models, "ram", base=0 if isinstance(models, list) else "base")
    assert str(refused.value) == message
    state = {"w": torch.zeros(2)}
    with pytest.raises(ParameterError, match=r"^ram: `base` must name the base model among \[0, 1\]; got dict$"):
        merge_state_dicts([state, state], "ram", base=state)  # type: ignore[arg-type]


def test_a_pin_for_some_models(bf16_models: ModelSet) -> None:
    """The documented pin of one model (the others' rho from the counts, as without the pin); mergekit's own
    function, which counts nothing, gives the same with every lambda pinned."""
    models = models_of(bf16_models)
    coder, *others = bf16_models.agents
    _, unpinned = merge_state_dicts(models, "ram_plus", base="base")
    merged, statistics = merge_state_dicts(models, "ram_plus", base="base", parameters={"lambda": {coder: 1.1}})
    assert [(m.lambda_, m.pinned) for m in statistics.models] == [
        (1.1, "lambda"),
        *((m.lambda_, None) for m in unpinned.models[1:]),
    ]
    pins = {"lambda": {model: stats.lambda_ for model, stats in zip(bf16_models.agents, statistics.models)}}
    theirs = mergekit_merge_state_dicts(models, "ram_plus", base="base", parameters=pins)
    assert all(torch.equal(theirs[name], tensor) for name, tensor in merged.items())


def test_strict_as_mergekit_has_it(bf16_models: ModelSet) -> None:
    """``strict=False`` merges the tensors every model has, as mergekit's own function does; ``strict``
    refuses the others, naming the model."""
    models = models_of(bf16_models)
    others = bf16_models.agents[1:]
    pruned = {**models, others[0]: {k: v for k, v in models[others[0]].items() if k != "model.norm.weight"}}
    with pytest.raises(ValueError, match=rf"^{others[0]}: tensors differ from the base's \(missing \['model.norm"):
        merge_state_dicts(pruned, "ram_plus", base="base")
    merged, statistics = merge_state_dicts(pruned, "ram_plus", base="base", strict=False)
    pins = {"lambda": {model: stats.lambda_ for model, stats in zip(bf16_models.agents, statistics.models)}}
    theirs = mergekit_merge_state_dicts(pruned, "ram_plus", base="base", strict=False, parameters=pins)
    assert set(merged) == set(theirs) == set(models["base"]) - {"model.norm.weight"}
    assert all(torch.equal(theirs[name], tensor) for name, tensor in merged.items())
    assert "model.norm.weight" not in [tensor.name for tensor in statistics.tensors]


def test_mixed_dtypes_give_the_promoted_dtype(bf16_models: ModelSet, fp32_models: ModelSet, tmp_path) -> None:
    """A float32 fine-tune with a bfloat16 base and fine-tune, no ``dtype`` or ``out_dtype``: every merged
    tensor is float32, the inputs' promoted dtype, as mergekit's own methods give (docs/reliability.md)."""
    models = {"base": load_weights(bf16_models.base), "a": load_weights(fp32_models.agents[0])}
    models["b"] = load_weights(bf16_models.agents[1])
    merged, _ = merge_state_dicts(models, "ram_plus", base="base")
    theirs = mergekit_merge_state_dicts(models, "task_arithmetic", base="base", parameters={"weight": 0.5})
    assert (
        {tensor.dtype for tensor in merged.values()} == {tensor.dtype for tensor in theirs.values()} == {torch.float32}
    )
    recipe = bf16_models.recipe("ram_plus")
    recipe["models"][0] = {"model": fp32_models.agents[0]}
    merge_in_process(recipe, str(tmp_path / "out"))
    assert {tensor.dtype for tensor in load_weights(str(tmp_path / "out")).values()} == {torch.float32}
