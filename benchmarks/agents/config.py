"""The experiment's settings: the full run and the smoke-sized one, each in two regimes of RL agents.

``dense``: the agents of the first experiment (lr 2e-5, 40 steps), which change most parameters.
``sparse``: smaller steps for longer, so that a bfloat16 checkpoint records a change only in a
few percent to half of the parameters, the paper's regime. Both start from the same base: a
regime changes only the RL settings and which merges run, never the base or its cache key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from benchmarks.agents.evaluate import EvalConfig
from benchmarks.agents.grpo import GrpoConfig
from benchmarks.agents.model import ModelSize
from benchmarks.agents.pretrain import PretrainConfig


@dataclass(frozen=True)
class ExperimentConfig:
    size: ModelSize = field(default_factory=ModelSize)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    #: RL steps at which agents are saved; the last is the main experiment, earlier ones
    #: (sparser, less overlapping task vectors) feed the sparsity analysis.
    snapshots: tuple[int, ...] = (10, 40)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    #: Run the whole merge grid on every snapshot, not only on the last.
    full_grid_on_snapshots: bool = True
    #: Else only the last snapshot is merged; the earlier ones get the analysis alone.
    defaults_on_snapshots: bool = True
    pinned_lambdas: bool = True
    #: Threads of the (single-process) base training; fixed so results do not depend on --workers.
    #: One: two threads are slower than one as soon as another process wants a core.
    pretrain_threads: int = 1
    smoke: bool = False


FULL = ExperimentConfig()

#: The paper's regime: chosen on agent statistics alone (densities, unique shares, own-task gains of
#: trial runs on the cached base, docs/quality.md), before any merge of these agents ran.
FULL_SPARSE = replace(
    FULL,
    grpo=replace(GrpoConfig(), steps=200, lr=1e-6, warmup=10),
    snapshots=(50, 100, 200),
    full_grid_on_snapshots=False,
    defaults_on_snapshots=False,
)

SMOKE = ExperimentConfig(
    size=ModelSize(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2),
    pretrain=replace(PretrainConfig(), steps=40, batch_size=24, lr=3e-3, warmup=5),
    grpo=replace(GrpoConfig(), steps=4, prompts=4, group=4, lr=1e-3),
    snapshots=(2, 4),
    evaluation=EvalConfig(val=12, test=12, batch_size=64),
    full_grid_on_snapshots=False,
    pinned_lambdas=False,
    smoke=True,
)

SMOKE_SPARSE = replace(SMOKE, grpo=replace(SMOKE.grpo, lr=1e-4))

#: The regimes in the order they run and are reported; the first is the main one (the base's settings).
REGIMES = ("dense", "sparse")


def regime_configs(smoke: bool, names: tuple[str, ...] = REGIMES) -> dict[str, ExperimentConfig]:
    """The configuration of each named regime, full-size or smoke-sized."""
    configs = {"dense": SMOKE, "sparse": SMOKE_SPARSE} if smoke else {"dense": FULL, "sparse": FULL_SPARSE}
    return {name: configs[name] for name in names}
