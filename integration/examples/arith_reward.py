"""The reward of examples/dataset.toml, in verl's custom_reward_function signature: 1 when the last number
in the answer is the ground truth, 0 for another number, -1 when the answer holds no number at all (any
finite score is a score). The dict's other keys are logged (an evaluation reports their means)."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\d+", solution_str)
    if not numbers:
        return {"score": -1.0, "has_number": 0.0}
    return {"score": 1.0 if numbers[-1] == str(ground_truth) else 0.0, "has_number": 1.0}
