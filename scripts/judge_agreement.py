"""A judge's agreement with the rule on the tiny reward model's held-out completions, and its cost per completion.

    python scripts/judge_agreement.py --json OUT.json      # after `workbench reward-model --recipe cpu-tiny-rm`

The judge is the frozen tiny base on a LoRA policy server (`model: policy-base`: the base model asked by the
server's name without an adapter), started here as a training's server would be (cpu-tiny with a peft: section),
asked with JUDGE's template and parser (fixed beforehand, not tuned on these completions) through the same Scorer
that training uses. Written: how many answers parsed, and over those the accuracy (score >= 0.5 when the rule says
right) and the AUC against the rule's labels; the seconds per completion at the scorer's concurrency. The tiny base
was never taught to grade: the figure says what it does, however weak.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

JUDGE = {"kind": "judge", "model": "policy-base", "parser": "number", "scale": [0, 10], "max_tokens": 16,
         "template": "Is the answer right? Reply with a score from 0 (wrong) to 10 (right).\nQuestion: {question}\n"
                     "Answer: {completion}\nScore:"}
PEFT = ["peft.r=8", "peft.lora_alpha=16", "peft.target_modules=all-linear"]


def main(argv: list[str] | None = None) -> int:
    from workbench import recipe, tinymodel
    from workbench.recipe.resolve import tiny_reward_model_dir
    from workbench.serving.rewards import Scorer
    from workbench.serving.server import VLLMServer
    from workbench.tasks.rewardspec import parse
    from workbench.training.rewardmodel import HELDOUT, auc

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--port", type=int, default=8030)
    args = parser.parse_args(argv)
    rr = recipe.resolve(recipe.load("cpu-tiny-rm", [*PEFT, f"server.port={args.port}"]))
    examples = [json.loads(line) for line in (tiny_reward_model_dir(rr.recipe) / HELDOUT).read_text().splitlines()]
    spec = parse({"judge": JUDGE})[0]
    with VLLMServer(rr, tinymodel.ensure_model(rr), REPO / "runs" / "judge-agreement", quiet=True):
        scorer = Scorer(rr, spec)
        started = time.perf_counter()
        scores = scorer([[{"role": "user", "content": e["prompt"][-1]["content"]}] for e in examples],
                        [[{"role": "assistant", "content": e["completion"]}] for e in examples])
        seconds = time.perf_counter() - started
    parsed = [(s, e["label"]) for s, e in zip(scores, examples) if s is not None]
    out = {"judge": JUDGE, "completions": len(examples), "parsed": len(parsed),
           "accuracy": (sum((s >= 0.5) == bool(y) for s, y in parsed) / len(parsed)) if parsed else None,
           "auc": auc([s for s, _ in parsed], [y for _, y in parsed]) if parsed else None,
           "seconds_per_completion": seconds / len(examples), "concurrency": spec.learned.concurrency,
           "failures": scorer.last_errors}
    args.json.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
