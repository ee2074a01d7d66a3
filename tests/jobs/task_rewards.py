"""A reward for the two-task tests (reward.custom_function=task_rewards:easy_is_solved): the tiny
random model never answers right, so the synthetic rule would score every task 0 and no weight
would move. This scores the difficulty-1 task 1 (saturated at once) and the other task 0."""


def easy_is_solved(data_source, solution_str, ground_truth, extra):
    return 1.0 if int(extra.get("difficulty", 0)) == 1 else 0.0


def score_and_checksum(data_source, solution_str, ground_truth, extra):
    """The jobs that must learn from something while the tiny random model answers nothing right
    (tests/jobs/test_recipes.py, tests/dist/trainer/test_split_async.py;
    reward.custom_function=task_rewards:score_and_checksum): two components, the task's own score and
    one of 1,000 values drawn from the text (its CRC-32), so two different responses score alike
    with probability 1/1,000 and a group has advantages unless all its responses are the same text
    (a one-bit component scores a group of two alike half the time)."""
    import zlib

    from verl_hpc.rewards import default_score

    accuracy = default_score(data_source, solution_str, ground_truth, extra)
    checksum = (zlib.crc32(solution_str.encode("utf-8", "surrogatepass")) % 1000) / 1000
    return {"score": accuracy + checksum, "accuracy": accuracy, "checksum": checksum}
