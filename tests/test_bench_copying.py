"""benchmarks/bench_copying.py: which assistant tokens start a dish's name, which continue it."""

import random

from transformers import AutoTokenizer

from kitchen import paths
from kitchen.scripted import renamed_row
from kitchen.world import phrase_pattern

from .conftest import load_benchmark

bench = load_benchmark("bench_copying")
POLICY = str(paths.DATA / "models" / "policy-tiny")


def test_tokens_are_split_into_a_names_first_token_its_rest_and_the_others():
    tok = AutoTokenizer.from_pretrained(POLICY)
    messages = [
        {"role": "system", "content": "Concierge. Diner: verbosity=brief, pace=hurried."},
        {"role": "user", "content": "Thai, please."},
        {"role": "tool", "content": "thai main: Pad See Ew (12$, 15min)"},
        {"role": "assistant", "content": "@order Pad See Ew"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    kinds = bench.token_kinds(text, messages, enc["offset_mapping"], phrase_pattern(["Pad See Ew"]))
    pieces = {k: "".join(text[s:e] for t, (s, e) in enumerate(enc["offset_mapping"])
                         if kinds.get(t) == k) for k in bench.KINDS}  # fmt: skip
    # the tool's mention of the dish is not the assistant's: only the order's name is read
    assert (pieces["first"] + pieces["rest"]).strip() == "Pad See Ew"
    assert pieces["first"].strip() and pieces["rest"].strip()
    assert pieces["other"].strip() == "@order"


def test_losses_count_every_assistant_token_once_renamed_or_not():
    row = {"messages": [
        {"role": "system", "content": "Concierge. Diner: verbosity=brief, pace=hurried."},
        {"role": "user", "content": "A thai main, please."},
        {"role": "assistant", "content": "@search thai main"},
        {"role": "tool", "content": "thai main: Pad See Ew (12$, 15min); Green Curry (13$, 20min)"},
        {"role": "assistant", "content": "Green Curry: 13$, 20 min. Order it?"},
    ]}  # fmt: skip
    new: dict[str, str] = {}
    renamed = renamed_row(row, random.Random(0), names=new)
    assert set(new) == {"Pad See Ew", "Green Curry"}
    real = bench.name_losses(POLICY, [(row, phrase_pattern(["Pad See Ew", "Green Curry"]))])
    fake = bench.name_losses(POLICY, [(renamed, phrase_pattern(list(new.values())))])
    assert real["first"][1] == fake["first"][1] == 1
    assert real["rest"][1] >= 1 and fake["rest"][1] >= 1
    assert real["other"][1] == fake["other"][1] > 5
    # a name the policy never saw costs it more than one of the menu it was trained on
    assert fake["rest"][0] > real["rest"][0]
