"""Rule-based scorers: gsm8k strict/flexible, math boxed answers and normalisation, exact, synthetic."""
import pytest

from verl_hpc.rewards import basic, gsm8k, math_answer


# GSM8K-format rows written here (question, reference answer, ground truth as prepare derives it)
GSM8K_ROWS = [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72",
     "72"),
    ("The rent is 12 * $1,200 = $<<12*1200=14400>>14,400 a year.\n#### 14,400", "14400"),
    ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute. For 50 minutes she earned 0.2 x 50 = $<<0.2*50=10>>10.\n"
     "#### 10", "10"),
    ("She had 5 apples, ate 7 more than she had and so owes -2.\n#### -2", "-2"),
    ("Total: 3 boxes of 1,000,000 grains, then 2.5 kg, so $3,000,000.\n#### $3,000,000", "3000000"),
]


@pytest.mark.parametrize("solution,truth", GSM8K_ROWS)
def test_gsm8k_reference_solutions_score_one(solution, truth):
    assert gsm8k.gsm8k_score(solution, truth) == 1.0
    assert gsm8k.gsm8k_score(solution, truth, method="flexible") == 1.0


@pytest.mark.parametrize("solution,truth", GSM8K_ROWS)
def test_gsm8k_wrong_final_number_scores_zero(solution, truth):
    wrong = solution.rsplit("####", 1)[0] + "#### 73"
    assert gsm8k.gsm8k_score(wrong, truth) == 0.0
    assert gsm8k.gsm8k_score(wrong, truth, method="flexible") == 0.0


def test_gsm8k_strict_needs_the_marker_and_flexible_does_not():
    text = "48 + 24 = 72 clips, so the answer is 72."
    assert gsm8k.gsm8k_score(text, "72") == 0.0
    assert gsm8k.gsm8k_score(text, "72", method="flexible") == 1.0
    assert gsm8k.extract_strict("#### 5 first, then #### 7") == "7"  # the last marker counts
    assert gsm8k.extract_flexible("it costs $1,234.50.") == "1,234.50"
    assert gsm8k.extract_flexible("10-3 = 7") == "7" and gsm8k.extract_flexible("it is -3") == "-3"
    assert gsm8k.extract_flexible("pairs 3,4 and 5") == "5"  # "3,4" is not a thousands group
    assert gsm8k.extract_flexible("no digits here") is None
    assert gsm8k.numbers_equal("18.00", "18") and gsm8k.numbers_equal("$1,200", "1200")
    assert not gsm8k.numbers_equal("abc", "abc")
    with pytest.raises(ValueError, match="valid: strict, flexible"):
        gsm8k.gsm8k_score("#### 1", "1", method="loose")


def test_gsm8k_ground_truth_check():
    assert gsm8k.check_ground_truth("1,200") is None
    assert "is not a number" in gsm8k.check_ground_truth("seventy-two")


@pytest.mark.parametrize("a,b", [
    ("0.5", "\\frac{1}{2}"), ("\\dfrac{1}{2}", "1/2"), ("\\tfrac12", "0.5"), (".5", "\\frac{2}{4}"),
    ("-\\frac{3}{4}", "-0.75"), ("\\frac{-3}{4}", "-\\frac34"),
    ("90^\\circ", "90"), ("90^{\\circ}", "90"), ("5 \\text{ cm}", "5"), ("12\\mbox{ inches}", "12"),
    ("\\$4.50", "4.5"), ("50\\%", "50"), ("7.", "7"), ("1,000", "1000"), ("1{,}000", "1000"),
    ("\\left( 1, 2 \\right)", "(1,2)"), ("x = 3", "3"), ("\\sqrt2", "\\sqrt{2}"), ("2 \\! \\sqrt{2}", "2\\sqrt{2}"),
    ("\\text{(A)}", "(A)"), ("\\displaystyle\\frac{\\pi}{2}", "\\frac{\\pi}{2}"), ("\\boxed{6}", "6"),
])
def test_math_equivalent_forms(a, b):
    assert math_answer.answers_equivalent(a, b), (math_answer.normalize_answer(a), math_answer.normalize_answer(b))


@pytest.mark.parametrize("a,b", [
    ("0.5", "\\frac{1}{3}"), ("(1,2)", "(2,1)"), ("\\sqrt{2}", "2"), ("x+1", "x-1"), ("", "0"), ("\\frac{1}{0}", "1"),
    ("\\leftarrow", "arrow"),
])
def test_math_different_answers(a, b):
    assert not math_answer.answers_equivalent(a, b)


def test_math_last_boxed_extraction():
    text = "First \\boxed{1}, finally $\\boxed{\\frac{a}{b^{2}}}$."
    assert math_answer.last_boxed(text) == "\\frac{a}{b^{2}}"
    assert math_answer.last_boxed("so \\fbox{ 3 }") == " 3 "
    assert math_answer.last_boxed("\\boxed{2} then \\fbox{5}") == "5"
    assert math_answer.last_boxed("answer: $\\boxed 7$") == "7"
    assert math_answer.last_boxed("\\boxed{\\frac{1}{2}") is None  # cut off mid-answer
    assert math_answer.last_boxed("no box") is None
    assert math_answer.math_score("Thus $\\boxed{\\dfrac{1}{2}}$.", "0.5") == 1.0
    assert math_answer.math_score("Thus $\\boxed{\\dfrac{1}{3}}$.", "0.5") == 0.0
    assert math_answer.math_score("The answer is 0.5", "0.5") == 0.0  # no box, no reward
    assert "empty after normalisation" in math_answer.check_ground_truth("\\$ ")


def test_exact_and_synthetic():
    assert basic.exact_match_score("  Paris\n", "Paris") == 1.0
    assert basic.exact_match_score("paris", "Paris") == 0.0
    assert basic.synthetic_arith_score("7", "7") == 1.0
    assert basic.synthetic_arith_score(" 7 and then more", "7") == 1.0
    assert basic.synthetic_arith_score("77", "7") == 0.0
    assert basic.synthetic_arith_score("8", "7") == 0.0 and basic.synthetic_arith_score("", "7") == 0.0
    assert basic.check_integer_ground_truth("12") is None
    assert "not an integer" in basic.check_integer_ground_truth("1.5")


@pytest.mark.parametrize("response,truth,score", [
    ("3", "3", 1.0), (" 3\n", "3", 1.0), ("3.", "3", 1.0), ("**3**, I think", "3", 1.0), ("3 dots", "3", 1.0),
    ("Red", "red", 1.0), ("RED!", "red", 1.0), ("'left'", "left", 1.0), ("red\nblue", "red", 1.0),
    ("blue", "Blue", 1.0),  # the ground truth is normalised the same way
    ("33", "3", 0.0), ("3dots", "3", 0.0), ("reddish", "red", 0.0), ("The answer is red", "red", 0.0),
    ("red,green", "red", 0.0), ("left-hand", "left", 0.0), ("4", "3", 0.0),
    ("", "3", 0.0), ("   ", "red", 0.0), ("...", "red", 0.0), ("!!!", "!!!", 0.0),  # no word is never right
])
def test_first_word_score(response, truth, score):
    assert basic.first_word_score(response, truth) == score


def test_word_ground_truth_check():
    assert basic.check_word_ground_truth("red") is None and basic.check_word_ground_truth(" 3 ") is None
    for bad in ("", "two words", "?!"):
        assert "is not one word" in basic.check_word_ground_truth(bad)
