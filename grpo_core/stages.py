"""The pipeline's stages, in the order an iteration runs them: the one place a stage is registered.

An entry says everything the rest of the code needs to know about a stage: the Prefect task that runs it
(named as "module:attribute", since grpo_core never imports tasks/), what it takes from the stages before it,
what it writes, its config section `stages.<name>` (retries, work pool, ...), whether it uses the accelerator,
and when it runs. The iteration flow (flows/train.py) runs the entries in order; the work-pool runner, the GPU
tag and the config read them. It is plain data: no Prefect, no torch.

Adding a stage: write the task (tasks/<name>.py, `@stage(name, key=...)`) and add a `Stage` to `STAGES`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import InitErrorDetails, ValidationError as CoreValidationError

# -- the settings a stage's config section holds ----------------------------------------------------

class StageRetryConfig(BaseModel):
    """Retry policy (and work pool) of one stage. Only transient errors (I/O, connection, timeout, container engine,
    CUDA out-of-memory) are retried; bad input (invalid config, malformed data) fails at once."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    retries: int = Field(1, ge=0, le=10, description="extra attempts after a transient failure")
    retry_delay_seconds: float = Field(2.0, ge=0, description="wait before the first retry")
    backoff_factor: float = Field(2.0, ge=1, description="each later retry waits this many times longer")
    retry_jitter_factor: float | None = Field(None, ge=0, description="random jitter on the delays (Prefect)")
    work_pool: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Prefect work pool whose worker runs this stage (as a flow run of the deployment "
                    "grpo-stage/<pool>); needs a Prefect server (PREFECT_API_URL) and a run directory the "
                    "workers share; None: in the training run's own process")

    def delays(self) -> list[float]:
        """The wait before each retry: retry_delay_seconds * backoff_factor**i."""
        return [self.retry_delay_seconds * self.backoff_factor ** i for i in range(self.retries)]


class ParallelStageConfig(StageRetryConfig):
    """The policy of a stage that can share its work among processes (tasks/distributed.py)."""
    num_processes: int = Field(
        1, ge=1, le=64,
        description="processes the stage runs on, started by the stage with `accelerate launch` on this machine: "
                    "one per GPU (NCCL), or on the CPU (gloo) when device is cpu or no GPU is visible. The update "
                    "is data parallel over groups (N processes take the step one process takes); rollout and "
                    "evaluate deal the prompts out, each process sampling its share. Under `accelerate launch`/"
                    "`torchrun` of `grpo train` itself, the launched processes are used instead")


class ScoreStageConfig(StageRetryConfig):
    """The score stage's policy."""
    during_rollout: bool = Field(
        True, description="score each group (rule rewards, and code sent to the sandbox) on a helper thread as soon "
                          "as the rollout has sampled it, so the score stage only adopts the result; applies when "
                          "the score stage runs where the rollout does (the same work_pool); the evaluate stage "
                          "scores its answers the same way. Reward functions then see a few whole groups per call "
                          "instead of the whole batch; turn it off for one that must run on the main thread or "
                          "would compete with sampling for the accelerator (a reward model)")


# -- the registry ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    """One pipeline stage. Its task is called as `task(config, run_dir, iteration, **inputs)`."""
    name: str
    task: str                                   # "module:attribute" of its @stage Prefect task
    inputs: dict[str, str]                      # parameter -> "checkpoint" | "state" | "<earlier stage>.<record field>"
    outputs: tuple[str, ...]                    # what it writes under iter-<k>/ besides its record <name>.json
    settings: type[StageRetryConfig] = StageRetryConfig   # the class of its config section stages.<name>
    defaults: dict[str, Any] = field(default_factory=dict)  # that section's values when a config leaves it out
    accelerator: bool = False                   # uses the GPU: carries stages.gpu_concurrency_tag
    when: Callable[[Any, int], bool] | None = None   # (GRPOConfig, k): runs in iteration k only when true; None: always
    moves_checkpoint: bool = False              # its record's checkpoint is where the iteration's later stages start


def _warm_start_due(cfg, iteration: int) -> bool:
    """Warm start once, before the first update."""
    return cfg.warmstart.enabled and iteration == 1


def _evaluation_due(cfg, iteration: int) -> bool:
    """Evaluate every eval.every iterations and after the last one."""
    return cfg.eval.enabled and (iteration % cfg.eval.every == 0 or iteration == cfg.pipeline_iterations)


STAGES: tuple[Stage, ...] = (
    Stage("warmstart", "tasks.warmstart:warmstart", inputs={"checkpoint": "checkpoint"},
          outputs=("warmstart/checkpoint", "warmstart/demonstrations.jsonl"), accelerator=True,
          when=_warm_start_due, moves_checkpoint=True),
    Stage("curate", "tasks.curate:curate", inputs={}, outputs=("prompts.jsonl",)),
    Stage("rollout", "tasks.rollout:rollout", inputs={"prompts": "curate.prompts", "checkpoint": "checkpoint"},
          outputs=("samples.jsonl", "early_scores.json"), settings=ParallelStageConfig, accelerator=True),
    Stage("score", "tasks.score:score", inputs={"prompts": "curate.prompts", "samples": "rollout.samples"},
          outputs=("scores.jsonl",), settings=ScoreStageConfig, defaults={"retries": 2}),
    Stage("update", "tasks.update:update",
          inputs={"samples": "rollout.samples", "scores": "score.scores", "checkpoint": "checkpoint", "state": "state"},
          outputs=("update/checkpoint", "update/trainer_state.pt"), settings=ParallelStageConfig, accelerator=True),
    Stage("evaluate", "tasks.evaluate:evaluate", inputs={"checkpoint": "update.checkpoint"},
          outputs=("eval_samples.jsonl",),
          settings=ParallelStageConfig, accelerator=True, when=_evaluation_due),
)


def names() -> tuple[str, ...]:
    """The stages' names, in order."""
    return tuple(s.name for s in STAGES)


def named(name: str) -> Stage:
    """The registered stage `name`; KeyError naming the stages there are."""
    for s in STAGES:
        if s.name == name:
            return s
    raise KeyError(f"no stage {name!r}; the stages are {', '.join(names())}")


def accelerator_stages() -> tuple[str, ...]:
    return tuple(s.name for s in STAGES if s.accelerator)


# -- the config's stages.<name> sections -------------------------------------------------------------

def stage_sections(data: dict, other_fields) -> dict:
    """`data` (the config's `stages:` mapping) with a validated section for every registered stage: the one
    given, or the stage's defaults. A key that is neither a stage nor one of `other_fields` is refused, naming
    the stages; errors inside a section keep their dotted place (e.g. score.retries)."""
    unknown = [k for k in data if k not in names() and k not in other_fields]
    if unknown:
        raise ValueError(f"stages.{unknown[0]}: no such stage; the stages are {', '.join(names())} (fix the name or "
                         f"remove the section)")
    sections, errors = {}, []
    for s in STAGES:
        given = data.get(s.name, s.defaults)
        try:
            sections[s.name] = given if isinstance(given, s.settings) else s.settings.model_validate(given)
        except ValidationError as e:
            errors += [_placed(error, s.name) for error in e.errors()]
    if errors:
        raise CoreValidationError.from_exception_data("StagesConfig", errors)
    return {**sections, **{k: v for k, v in data.items() if k not in sections}}


def _placed(error: dict, section: str) -> InitErrorDetails:
    """A section's validation error, placed under the section's name."""
    placed = {"type": error["type"], "loc": (section, *error["loc"]), "input": error["input"]}
    return {**placed, "ctx": error["ctx"]} if "ctx" in error else placed
