"""staros-stardata 0.1.1's constraint gym (PyPI, Apache-2.0) as a verifiers 0.4 taskset: a thin wrapper.

The package targets verifiers' old v0 API (`vf.SingleTurnEnv`, `vf.Rubric`), which verifiers 0.4 no longer has, so
its `load_environment()` cannot run here; its dataset builders and reward functions are plain Python and are used
as they are. Ours is only the v1 shape: the row type, one Task whose reward and metrics call the package's, and a
Taskset whose load() yields the package's rows. With this directory on PYTHONPATH the id is `stardata_taskset`.
"""
import json
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf
from stardata.envs import constraint_gym as gym          # the package: dataset builders, rewards, metrics

REWARDS = {"lipogram": (gym.lipogram_reward, gym.lipogram_metrics),   # its hardened lipogram reward (RL flagship)
           "forms": (gym.prosody_reward, gym.component_metrics)}       # its composite of every form's verifiers


class ConstraintData(vf.TaskData):
    answer: str           # the constraints as text (the pipeline's task answer; the reward reads `spec`)
    spec: dict            # the package's row `answer`: the FormSpec (constraints) its reward checks
    info: dict            # the package's row `info` (spec, form, topic, letter)


class ConstraintTaskConfig(vf.TaskConfig):
    reward: Literal["lipogram", "forms"] = "lipogram"


class ConstraintTask(vf.Task[ConstraintData, vf.State, ConstraintTaskConfig]):
    @vf.reward
    async def constraint(self, task, trace) -> float:
        return REWARDS[self.config.reward][0](trace.last_reply, answer=task.spec, info=task.info)

    @vf.metric
    async def components(self, task, trace) -> dict:
        return REWARDS[self.config.reward][1](trace.last_reply, answer=task.spec, info=task.info)


class ConstraintConfig(vf.TasksetConfig):
    task: ConstraintTaskConfig = ConstraintTaskConfig()
    dataset: Literal["lipogram", "forms"] = "lipogram"
    letters: list[str] = list(gym.LIPOGRAM_LETTERS)     # lipogram: the forbidden letters
    holdout: bool = False                               # lipogram: the package's held-out topics
    forms: list[str] | None = None                      # forms: which (None: the package's nine)
    topics_per_form: int = 4


class ConstraintTaskset(vf.Taskset[ConstraintTask, ConstraintConfig]):
    def load(self) -> Iterator[ConstraintTask]:
        c = self.config
        rows = (gym.build_lipogram_dataset(tuple(c.letters), holdout=c.holdout) if c.dataset == "lipogram"
                else gym.build_dataset(c.forms, c.topics_per_form))
        for i, row in enumerate(rows):
            data = ConstraintData(id=f"{row['info']['form']}-{i}", prompt=row["prompt"], spec=row["answer"],
                                  answer=json.dumps(row["answer"], sort_keys=True, default=str), info=row["info"])
            yield ConstraintTask(data, c.task)


def accepted(prompts, completions, verifiers_task=None, **_) -> list[float | None]:
    """The package's own pass/fail (`accepted`: its per-form threshold) as the run's correctness_func."""
    rows = verifiers_task or [None] * len(completions)
    return [None if row is None else gym.component_metrics(c, answer=row["spec"], info=row["info"])["accepted"]
            for c, row in zip(completions, rows)]


__all__ = ["ConstraintTaskset"]
