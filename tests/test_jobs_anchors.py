"""Each anchor whose source states its configuration in a file form (torchtune's recipe and overrides, the transformers
guide's Trainer arguments, fsdp_qlora's train.py arguments) derives, through bench.jobs, exactly the case the anchor
predicts: so the error of the configuration's prediction is the anchor's, row by row."""

from __future__ import annotations

import pytest
import yaml

from bench.analysis.anchors import ANCHOR_DIR, MODEL_DIR, load_file, plan_row
from bench.jobs import derive_job
from bench.jobs.job import workload_options
from strategies import parse_strategy

SOURCES = ("torchtune", "transformers", "fsdp_qlora")
# anchor -> (what the translation derives that the hand-written case lacks, what the hand-written has that it lacks).
# Empty: every anchor's case is what its configuration derives. Until 2026-11-28 the transformers and fsdp_qlora
# rows computed the loss from the logits where the Trainer and train.py take the model's own (labels=), and the
# guide's bitsandbytes Adam8bit was predicted in torchao's layout; the anchors now run the derived case.
DIFFERENCES: dict[str, tuple[set[str], set[str]]] = {}


def _referenced_anchors():
    for source in SOURCES:
        rows = {row["name"]: row for row in yaml.safe_load((ANCHOR_DIR / f"{source}.yaml").read_text())["rows"]}
        for anchor in load_file(ANCHOR_DIR / f"{source}.yaml"):
            yield pytest.param(anchor, rows[anchor.name]["config"], id=anchor.name)


def _members(spec: str) -> set[str]:
    """The canonical members of a spec, LoRA targets as a sorted set (peft adapts the same modules in any order)."""
    members = set()
    for member in parse_strategy(spec).spec().split("+"):
        parts = [("targets=" + "/".join(sorted(p[8:].split("/")))) if p.startswith("targets=") else p
                 for p in member.split(":")]
        members.add(":".join(parts))
    return members


def _options(workload: str) -> set[str]:
    _, options = workload_options(workload)
    defaults = {"attn": "sdpa", "task": "causal_lm"}  # the workload's own choices for these decoders
    return {f"{k}={v}" for k, v in options.items() if defaults.get(k) != v}


@pytest.mark.parametrize("anchor, reference", list(_referenced_anchors()))
def test_the_anchor_s_configuration_derives_its_case(anchor, reference):
    model = str(MODEL_DIR / f"{reference['model']}.json")
    job = derive_job(ANCHOR_DIR / reference["file"], reference["overrides"], model=model)
    if "seq_len" in reference:  # an unpacked batch's length is the data's: the anchor's assumption, given as a user would
        job, _ = job.with_explicit(workload=f"hf:{model}:seq_len={reference['seq_len']}")
    predicted, _ = plan_row(anchor)  # the hand-written spec that runs (its fallback where it does not parse)
    derived = _members(job.strategy) | _options(job.workload)
    written = _members(predicted) | _options(anchor.workload())
    assert job.batch_size * (job.ranks or 1) == anchor.global_batch and (job.ranks or 1) == anchor.ranks
    assert workload_options(job.workload)[0] == f"hf:{model}"
    assert (derived - written, written - derived) == DIFFERENCES.get(anchor.name, (set(), set()))
    assert not [use for use in job.keys if use.fate not in ("used", "ignored", "not modelled")]


def test_every_anchor_of_the_three_sources_has_its_configuration():
    names = {param.id for param in _referenced_anchors()}
    anchors = {a.name for s in SOURCES for a in load_file(ANCHOR_DIR / f"{s}.yaml")}
    assert names == anchors
