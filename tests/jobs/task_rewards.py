"""A reward for the two-task tests (reward.custom_function=task_rewards:easy_is_solved): the tiny
random model never answers right, so the synthetic rule would score every task 0 and no weight
would move. This scores the difficulty-1 task 1 (saturated at once) and the other task 0."""


def easy_is_solved(data_source, solution_str, ground_truth, extra):
    return 1.0 if int(extra.get("difficulty", 0)) == 1 else 0.0


def score_and_parity(data_source, solution_str, ground_truth, extra):
    """GDPO's job test (tests/jobs/test_recipes.py, reward.custom_function=task_rewards:score_and_parity):
    two components, the task's own score and a stand-in that varies with the text (the parity of its
    characters' codes), so the random model's groups differ in at least one of them."""
    from verl_hpc.rewards import default_score

    accuracy = default_score(data_source, solution_str, ground_truth, extra)
    parity = float(sum(map(ord, solution_str)) % 2)
    return {"score": accuracy + parity, "accuracy": accuracy, "parity": parity}
