"""Makes the `datasets` directories under hf/ that test_dataset.py reads with gyre's own reader, and
hf/expected.json: what HuggingFace `datasets` itself reads back from each (`load_from_disk(...).to_list()`).
Run again (from the repository root) only to refresh them:

    uv run --no-project --python .venv/bin/python --with datasets python integration/tests/data/make_hf_datasets.py
"""

import json
import shutil
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent / "hf"


def rows() -> list[dict]:
    out = []
    for i, (a, b) in enumerate([(2, 3), (4, 4), (7, 2), (9, 1)]):
        prompt = [{"role": "user", "content": f"What is {a} + {b}?"}]
        if i == 0:
            prompt.insert(0, {"role": "system", "content": "Answer with a number."})
        out.append(
            {
                "data_source": "arith",
                "prompt": prompt,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    return out


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    ds = datasets.Dataset.from_list(rows())
    ds.save_to_disk(HERE / "arith")
    ds.shuffle(seed=1).select([0, 1, 2]).save_to_disk(HERE / "arith-shuffled")
    datasets.DatasetDict({"train": ds, "test": ds.select([3])}).save_to_disk(HERE / "arith-dict")
    expected = {
        name: datasets.load_from_disk(str(HERE / name)).to_list() for name in ("arith", "arith-shuffled")
    }
    expected["version"] = datasets.__version__
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
