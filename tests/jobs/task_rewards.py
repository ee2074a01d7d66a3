"""A reward for the two-task tests (reward.custom_function=task_rewards:easy_is_solved): the tiny
random model never answers right, so the synthetic rule would score every task 0 and no weight
would move. This scores the difficulty-1 task 1 (saturated at once) and the other task 0."""


def easy_is_solved(data_source, solution_str, ground_truth, extra):
    return 1.0 if int(extra.get("difficulty", 0)) == 1 else 0.0
