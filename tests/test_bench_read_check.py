"""benchmarks/bench_read_check.py: the one-decision drill that asks whether a policy of the tiny
shape can learn to read an allergen check."""

import random

from transformers import AutoTokenizer

from kitchen import paths
from kitchen.world import load_menu

from .conftest import load_benchmark

bench = load_benchmark("bench_read_check")
TOKENIZER = str(paths.DATA / "models" / "policy-tiny")


def test_examples_are_labelled_by_the_overlap_and_held_out_lists_stay_out():
    """An example is unsafe exactly when the dish holds one of the diner's allergens; the lists
    it draws from are the ones given, so the held-out lists never reach training."""
    train, held = bench.allergy_lists(0)
    assert len(held) == 8 and not set(train) & set(held)
    assert len(train) + len(held) == 9 + 36
    menu = load_menu()
    rng = random.Random(3)
    for i in range(200):
        e = bench.example(rng, train, list(menu.dishes), i % 2 == 0, filler=i % 3)
        system = e.text.split("<|im_end|>")[0]
        allergies = set(system.split("allergies=")[1].rstrip(".").split(","))
        assert tuple(sorted(allergies)) not in {tuple(sorted(h)) for h in held}
        dish = menu.by_name[e.text.split("<|im_start|>tool\n")[-1].split(":")[0].lower()]
        assert e.unsafe == (i % 2 == 0) == bool(set(dish.allergens) & allergies)
        assert e.target == ("@allergens" if e.unsafe else dish.name)
        assert e.text.count("<|im_start|>tool") == (2 if i % 3 else 1)


def test_the_reply_form_spells_the_diners_allergens_with_the_checks_own_tokens():
    """`--profile reply` is what the flag promises: the profile's allergen tokens are the very
    tokens of the check's reply; the world's form (`=peanut`, `,sesame`) shares none."""
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    reply = set(tok("allergens: peanut, sesame")["input_ids"])

    def allergen_tokens(form: str) -> set[int]:
        text = bench.profile(("peanut", "sesame"), form)
        ids = tok(text.split("diet=any,")[1])["input_ids"]
        return {i for i in ids if "peanut" in tok.decode([i]) or "sesame" in tok.decode([i])}

    assert allergen_tokens("reply") and allergen_tokens("reply") <= reply
    assert allergen_tokens("world") and not allergen_tokens("world") & reply


def test_a_batch_ends_every_row_at_the_decision():
    """Left padding puts every example's assistant header last, so the logits at the last
    position are the next turn's first token; the target is that token of the label."""
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    train, _ = bench.allergy_lists(0)
    rng = random.Random(0)
    examples = [
        bench.example(rng, train, list(load_menu().dishes), i % 2 == 0, filler=3 * i)
        for i in range(4)
    ]
    inputs, targets = bench.batch(tok, examples)
    header = tok("<|im_start|>assistant normal relaxed\n", add_special_tokens=False)["input_ids"]
    for row, mask, e, target in zip(
        inputs["input_ids"], inputs["attention_mask"], examples, targets, strict=True
    ):
        assert row[-len(header) :].tolist() == header
        assert tok.decode(row[mask.bool()]) == e.text
        assert target.item() == tok(e.target, add_special_tokens=False)["input_ids"][0]
    assert len({int(m.sum()) for m in inputs["attention_mask"]}) == 4  # lengths differ
