"""Recipe parameters: refusals that name the parameter, and pinned statistics."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from mergekit.config import MergeConfiguration
from mergekit.merge_methods.base import TensorGroup
from mergekit.scripts.run_yaml import main as mergekit_yaml

from mergekit_ram import merge_state_dicts
from mergekit_ram.integration.recipes import check_recipe
from mergekit_ram.parameters import ParameterError
from tests import reference
from tests.conftest import (
    Merged,
    ModelSet,
    command_refusal,
    load_statistics,
    load_weights,
    merge_in_process,
    write_recipe,
)


@pytest.mark.parametrize(
    ("parameters", "model_parameters", "message"),
    [
        ({"r": -0.1}, None, "ram_plus: parameter 'r' in parameters must be a finite number >= 0; got -0.1"),
        ({"alpha": -2}, None, "parameter 'alpha' in parameters must be a finite number >= 0; got -2"),
        ({"epsilon": -1e-5}, None, "parameter 'epsilon' in parameters must be a finite number >= 0"),
        ({"epsilon": float("nan")}, None, "parameter 'epsilon' in parameters must be a finite number >= 0"),
        ({"rule": "tanh"}, None, "parameter 'rule' in parameters must be 'clip' (RAM+) or 'soft' (RAM+s); got 'tanh'"),
        ({"apha": 2.0}, None, "unknown parameter 'apha' in parameters (did you mean 'alpha'?); valid names: alpha"),
        ({"r": [{"filter": "mlp", "value": -1}, {"value": 0.1}]}, None, "parameter 'r' in parameters must be"),
        (None, {"lamda": 1.1}, "unknown parameter 'lamda' in models[1].parameters (did you mean 'lambda'?)"),
        (None, {"rho": -3}, "parameter 'rho' in models[1].parameters must be a finite number >= 0"),
        # multislerp declares `eps`, but it is a near miss of ours: an error, not a warning.
        (None, {"eps": 1e-3}, "unknown parameter 'eps' in models[1].parameters (did you mean 'epsilon'?)"),
        ({"gamma_prime": 1}, None, "unknown parameter 'gamma_prime' in parameters; valid names: alpha, epsilon"),
        # YAML booleans are not numbers (pydantic alone reads true as 1.0, false as 0.0).
        ({"r": True}, None, "parameter 'r' in parameters must be a finite number >= 0; got True (true/false is a"),
        ({"epsilon": False}, None, "parameter 'epsilon' in parameters must be a finite number >= 0; got False"),
        (None, {"lambda": True}, "parameter 'lambda' in models[1].parameters must be a finite number >= 0"),
        # Beyond float32: refused with the parameter named (1e300 gave NaN or an unnamed overflow).
        (None, {"lambda": 1e300}, "ram_plus: parameter 'lambda' in models[1].parameters is 1e+300, above the largest"),
        (
            {"r": 1e300},
            None,
            "ram_plus: parameter 'r' in parameters is 1e+300, above the largest float32 (3.40282e+38)",
        ),
        ({"r": 1e20, "alpha": 1e20}, None, "ram_plus: r = 1e+20 in parameters allows lambda up to 1e+40, above"),
        ({"r": 1e39, "rule": "soft"}, None, "parameter 'r' in parameters is 1e+39, above the largest float32"),
        # Whole-merge settings in one model's block: mergekit would ignore them there.
        (None, {"r": 0.2}, "parameter 'r' in models[1].parameters is set for one model, but r applies to the whole"),
        (None, {"alpha": 1}, "'alpha' in models[1].parameters is set for one model, but alpha applies to the whole"),
        (None, {"rule": "soft"}, "'rule' in models[1].parameters is set for one model, but rule applies to the whole"),
        (None, {"epsilon": 1e-3}, "move it to the top-level `parameters:` (epsilon may vary per tensor with"),
    ],
)
def test_invalid_parameters_are_refused_before_anything_is_read(
    bf16_models: ModelSet, tmp_path, parameters, model_parameters, message: str
) -> None:
    recipe = bf16_models.recipe("ram_plus")
    if parameters is not None:
        recipe["parameters"] = parameters
    if model_parameters is not None:
        recipe["models"][1]["parameters"] = model_parameters
    out = str(tmp_path / "out")
    with pytest.raises(ParameterError) as error:
        merge_in_process(recipe, out)
    assert message in str(error.value)
    assert not os.path.exists(out)  # refused before the output folder (or any tensor) was touched


def test_slice_sources_are_model_blocks_too(bf16_models: ModelSet, tmp_path) -> None:
    sources = [{"model": path, "layer_range": [0, 2]} for path in [*bf16_models.agents, bf16_models.base]]
    sources[2]["parameters"] = {"epsilon": 1e-3}
    recipe = {"merge_method": "ram", "base_model": bf16_models.base, "slices": [{"sources": sources}]}
    with pytest.raises(
        ParameterError, match=r"'epsilon' in slices\[0\]\.sources\[2\]\.parameters is set for one model"
    ):
        merge_in_process(recipe, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    recipe["slices"][0]["parameters"] = {"epsilon": 1e-3}  # a slice's own block is shared: accepted
    del sources[2]["parameters"]
    check_recipe("ram", MergeConfiguration.model_validate(recipe))


def test_other_methods_parameters_are_ignored_with_a_warning(bf16_models: ModelSet, caplog) -> None:
    """mergekit's built-in ram ignored them; so do ours, saying so (the names come from the registry)."""
    recipe = bf16_models.recipe("ram", parameters={"r": 0.1, "density": 0.5})
    recipe["models"][0]["parameters"] = {"weight": 0.6, "lambda": 1.2}
    recipe["models"][1]["parameters"] = {"weight": 0.4}
    with caplog.at_level(logging.WARNING, logger="mergekit_ram.integration.recipes"):
        check_recipe("ram", MergeConfiguration.model_validate(recipe))
        check_recipe("ram_plus", MergeConfiguration.model_validate({**recipe, "merge_method": "ram_plus"}))
    assert caplog.messages == [  # in recipe order: models, then the top-level parameters
        "ram ignores parameter 'weight' (in models[0].parameters, models[1].parameters): it is a parameter of "
        "breadcrumbs, breadcrumbs_ties, dare_linear, dare_ties and 7 more, not of ram",
        "ram ignores parameter 'lambda' (in models[0].parameters): it is a parameter of breadcrumbs, "
        "breadcrumbs_ties, dare_linear, dare_ties and 6 more, not of ram; set merge_method: ram_plus or ram_ties "
        "to use it",
        "ram ignores parameter 'r' (in parameters): it is a parameter of ram_plus, ram_ties, ramplus_tl, not of "
        "ram; set merge_method: ram_plus or ram_ties to use it",
        "ram ignores parameter 'density' (in parameters): it is a parameter of breadcrumbs, breadcrumbs_ties, "
        "dare_linear, dare_ties and 5 more, not of ram; set merge_method: ram_ties to use it",
        "ram_plus ignores parameter 'weight' (in models[0].parameters, models[1].parameters): it is a parameter "
        "of breadcrumbs, breadcrumbs_ties, dare_linear, dare_ties and 7 more, not of ram_plus",
        "ram_plus ignores parameter 'density' (in parameters): it is a parameter of breadcrumbs, "
        "breadcrumbs_ties, dare_linear, dare_ties and 5 more, not of ram_plus; set merge_method: ram_ties to use it",
    ]


def test_declared_names_are_asked_of_the_registry_at_check_time(bf16_models: ModelSet, caplog) -> None:
    """A method registered after mergekit-ram (another plugin) makes its parameter names known."""
    from mergekit.merge_methods import registry
    from mergekit.merge_methods.easy_define import merge_method

    recipe = MergeConfiguration.model_validate(bf16_models.recipe("ram_plus", parameters={"zeta_scale": 2.0}))
    with pytest.raises(ParameterError, match="unknown parameter 'zeta_scale' in parameters; valid names"):
        check_recipe("ram_plus", recipe)

    @merge_method(name="zeta_test_method", pretty_name="Zeta", reference_url="https://example.org")
    def zeta(group: TensorGroup, zeta_scale: float = 1.0) -> torch.Tensor:
        return group.tensors[0] * zeta_scale

    registry.register(zeta)
    try:
        with caplog.at_level(logging.WARNING, logger="mergekit_ram.integration.recipes"):
            check_recipe("ram_plus", recipe)
        assert caplog.messages == [
            "ram_plus ignores parameter 'zeta_scale' (in parameters): it is a parameter of zeta_test_method, "
            "not of ram_plus"
        ]
    finally:
        registry._METHODS.pop("zeta_test_method", None)


def test_the_upstream_ram_recipe_merges_with_a_warning(bf16_models: ModelSet, upstream_ram_merge: Merged) -> None:
    """mergekit's own test_ram_merge recipe shape (weight on each model) merges, as with the built-in."""
    assert (
        "ram ignores parameter 'weight' (in models[0].parameters, models[1].parameters, models[2].parameters): "
        "it is a parameter of breadcrumbs, breadcrumbs_ties, dare_linear, dare_ties and 7 more, not of ram"
    ) in upstream_ram_merge.stderr
    assert load_statistics(upstream_ram_merge.out)["method"] == "ram"
    base = load_weights(bf16_models.base)
    finetunes = [load_weights(path) for path in bf16_models.agents]
    for name, tensor in load_weights(upstream_ram_merge.out).items():  # weight changed nothing
        expected = reference.merge(base[name], [ft[name] for ft in finetunes], 1e-5, [1.0, 1.0, 1.0])
        assert torch.equal(tensor, expected.to(torch.bfloat16)), name


def test_implausible_lambda_is_a_warning_naming_the_model(bf16_models: ModelSet, tmp_path, caplog) -> None:
    recipe = bf16_models.recipe("ram_plus")
    for entry, value in zip(recipe["models"], (4.5, 1.2, 4.0)):
        entry["parameters"] = {"lambda": value}
    out = str(tmp_path / "out")
    with caplog.at_level(logging.WARNING):
        merge_in_process(recipe, out)
    expected = (
        f"{bf16_models.agents[0]}: lambda 4.5 is implausibly large (the paper's are about 1.2; above 4 its unique "
        "updates are applied more than 4-fold): check r and alpha, or the pinned lambda"
    )
    assert load_statistics(out)["warnings"] == [expected]  # 4.0 itself is not warned about
    assert expected in caplog.messages


def test_r_must_be_one_value_for_the_whole_merge(bf16_models: ModelSet, tmp_path) -> None:
    recipe = bf16_models.recipe("ram_plus", parameters={"r": [{"filter": "mlp", "value": 0.2}, {"value": 0.1}]})
    with pytest.raises(ParameterError, match="parameter 'r' must be one value for the whole merge"):
        merge_in_process(recipe, str(tmp_path / "out"))


def test_the_command_line_shows_the_message(bf16_models: ModelSet, tmp_path) -> None:
    """`lambda: 1e300` made 96% of the output NaN; now mergekit-yaml's command stops naming it
    (run in-process; its one-line output: tests/test_cli.py)."""
    recipe = bf16_models.recipe("ram_plus")
    recipe["models"][1]["parameters"] = {"lambda": 1e300}
    assert command_refusal(mergekit_yaml, write_recipe(str(tmp_path / "r.yml"), recipe), str(tmp_path / "out")) == (
        "ram_plus: parameter 'lambda' in models[1].parameters is 1e+300, "
        "above the largest float32 (3.40282e+38) the merge computes in"
    )
    assert not os.path.exists(str(tmp_path / "out"))


@pytest.mark.parametrize("kind", ["rho", "lambda"])
def test_pinned_statistics_skip_the_prepass_and_reproduce(
    bf16_models: ModelSet, ram_plus_merge: Merged, tmp_path, kind: str
) -> None:
    computed = ram_plus_merge.out  # the same recipe, counted by the pre-pass
    figures = load_statistics(computed)["models"]

    pinned_recipe = bf16_models.recipe("ram_plus")
    for entry, stats in zip(pinned_recipe["models"], figures):
        entry["parameters"] = {kind: stats[kind] if stats[kind] is not None else 1e9}
    pinned = str(tmp_path / "pinned")
    merge_in_process(pinned_recipe, pinned)
    statistics = load_statistics(pinned)
    assert statistics["source"] == "merge"  # no pre-pass ran
    assert [m["pinned"] for m in statistics["models"]] == [kind] * 3
    assert [m["lambda"] for m in statistics["models"]] == [m["lambda"] for m in figures]
    assert [m["shared"] for m in statistics["models"]] == [m["shared"] for m in figures]
    expected = load_weights(computed)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in load_weights(pinned).items())


def test_in_memory_api_refuses_bad_values(bf16_models: ModelSet) -> None:
    base = load_weights(bf16_models.base)
    models = {"base": base, "coding": base}
    with pytest.raises(ParameterError, match="parameter 'alpha' in merge_state_dicts arguments must be"):
        merge_state_dicts(models, "ram_plus", base="base", parameters={"alpha": -1.0})
    with pytest.raises(ParameterError, match="parameter 'r' in merge_state_dicts arguments must be .* got True"):
        merge_state_dicts(models, "ram_plus", base="base", parameters={"r": True})
    with pytest.raises(ParameterError, match="rho set for unknown model 'coder'"):
        merge_state_dicts(models, "ram_plus", base="base", parameters={"rho": {"coder": 1.0}})


def test_pinned_lambda_applies_with_r_zero_on_every_path(bf16_models: ModelSet, tmp_path) -> None:
    """r = 0 makes unpinned lambdas 1; a pinned lambda still applies, in files and in memory."""
    recipe = bf16_models.recipe("ram_plus", parameters={"r": 0.0})
    recipe["models"][0]["parameters"] = {"lambda": 1.3}
    out = str(tmp_path / "out")
    merge_in_process(recipe, out)
    assert [m["lambda"] for m in load_statistics(out)["models"]] == [1.3, 1.0, 1.0]
    base = load_weights(bf16_models.base)
    finetunes = [load_weights(path) for path in bf16_models.agents]
    merged = load_weights(out)
    for name in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        expected = reference.merge(base[name], [ft[name] for ft in finetunes], 1e-5, [1.3, 1.0, 1.0])
        assert torch.equal(merged[name], expected.to(torch.bfloat16)), name
    models = {"base": base, **dict(zip(bf16_models.agents, finetunes))}
    parameters = {"r": 0.0, "lambda": {bf16_models.agents[0]: 1.3}}
    in_memory, _ = merge_state_dicts(models, "ram_plus", base="base", parameters=parameters)
    assert all(torch.equal(in_memory[name], merged[name]) for name in merged)
