"""Evaluation suites (`suites:`): lm-eval tasks with their protocol, and the text KL is measured on."""

from __future__ import annotations

from typing import Any

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from quantgate.catalog.spec import Strict


class LocalTask(Strict):
    """An lm-eval task YAML shipped in catalog/lm_eval_tasks (or any folder given by path).

    `metadata` is merged over the task's own metadata (lm-eval's --metadata, for this task alone); tasks
    built by code read their size from it, e.g. qg_passkey's context_words.

    The protocol, as lm-eval's simple_evaluate takes it: `num_fewshot` (None: the suite's, else the task's
    own), `apply_chat_template` (the model's chat template around every prompt) and `fewshot_as_multiturn`
    (each few-shot example a user/assistant turn of its own, instead of one user turn holding them all)."""

    name: str
    include_path: str | None = None
    limit: int | None = Field(default=None, ge=1)
    metadata: dict[str, int | float | str | bool | list[int | float | str]] = {}
    num_fewshot: int | None = Field(default=None, ge=0)
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False

    @model_validator(mode="after")
    def _multiturn_needs_chat(self) -> LocalTask:
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ValueError("fewshot_as_multiturn needs apply_chat_template: true (turns exist only in a chat)")
        return self


class SuiteSpec(Strict):
    tasks: tuple[LocalTask, ...]
    batch_size: int = Field(default=8, ge=1)
    num_fewshot: int | None = Field(default=None, ge=0)
    # The text the variants' token-level KL divergence from the base is measured on. None: simple_stories.txt
    # under the eval data root (the perplexity task's text). Never the calibration data: the overlap check
    # refuses a calibration set that shares text with it.
    kl_text: str | None = None
    # The engine-drift sentinel (issue 45, item 3): each run re-measures the base on the first `probe` items of
    # every task a quality gate names (a group's: of each subtask), with the evaluation's own engine and arguments,
    # and sets them beside the model's previous run's, item for item. A move beyond the paired interval's noise
    # while only library versions changed is engine drift, named in every verdict of the run. None: no probe.
    probe: int | None = Field(default=None, ge=1)

    @model_serializer(mode="wrap")
    def _probe_only_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Without a probe the suite dumps as before there was one: catalog hashes, the nightly's inputs and
        # resume keys of every suite that sets none stay as they were.
        data = handler(self)
        if self.probe is None:
            data.pop("probe", None)
        return data

    def num_fewshot_of(self, task: LocalTask) -> int | None:
        """The few-shot count asked of `task`: its own, else the suite's (None: the task YAML's default)."""
        return self.num_fewshot if task.num_fewshot is None else task.num_fewshot
