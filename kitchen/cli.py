"""The `kitchen` command line: every stage of the kit as a subcommand.

Every subcommand imports what it needs when it runs, so `kitchen --help` is instant. A user
mistake (a bad file, a bad argument) prints `PATH:LINE: where: what is wrong and how to fix it`
and exits 2 — never a traceback. Bugs in the kit itself still raise, so they get reported.
Numbers a flag takes are checked by argparse itself (`count`, `fraction`: a usage error, exit 2),
so a value argparse accepts is one the kit can use.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kitchen.config import KitchenError

EXIT_USER_ERROR = 2


def count(lo: int = 1, hi: int | None = None) -> Callable[[str], int]:
    """An argparse `type`: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if n < lo or (hi is not None and n > hi):
            bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {n}")
        return n

    return parse


def fraction(text: str) -> float:
    """An argparse `type`: a finite number in [0, 1]."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not (math.isfinite(x) and 0 <= x <= 1):
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return x


def _folder_to_write(flag: str, path: str) -> None:
    """A folder a command will create or fill: not an existing file."""
    if Path(path).exists() and not Path(path).is_dir():
        raise KitchenError(f"{flag} {path}: is a file; give a folder")


def _file_to_write(flag: str, path: str) -> None:
    """A file a command will write: not a folder, and its folder exists."""
    p = Path(path)
    if p.is_dir():
        raise KitchenError(f"{flag} {path}: is a folder; give a file name")
    if not p.parent.is_dir():
        raise KitchenError(f"{flag} {path}: no folder {p.parent} to write it in")


def _constitution_validate(args: argparse.Namespace) -> int:
    from kitchen.constitution import load_constitution

    failed = 0
    for path in args.paths:
        try:
            c = load_constitution(path)
        except KitchenError as e:
            failed += 1
            for p in e.problems:
                print(p, file=sys.stderr)
            continue
        print(
            f"{path}: ok: {c.name}@{c.version}: {len(c.axioms)} axioms, {len(c.theorems)} "
            f"theorems, {len(c.dimensions)} dimensions"
        )
    return EXIT_USER_ERROR if failed else 0


def _constitution_personalize(args: argparse.Namespace) -> int:
    from kitchen.config import read_yaml, validate_doc
    from kitchen.constitution import check_profile, load_constitution, personalize, render_text
    from kitchen.profile import Profile

    c = load_constitution(args.path)
    doc = read_yaml(args.profile)
    profile = validate_doc(Profile, doc)
    problems = check_profile(c, profile)
    if problems:
        raise KitchenError([doc.problem(loc, msg) for loc, msg in problems])
    pc = personalize(c, profile)
    if args.format == "text":
        print(render_text(pc))
    elif args.format == "json":
        print(pc.model_dump_json(indent=2))
    else:
        print(f"# personal constitution {pc.version}", end="\n")
        print(pc.to_yaml(), end="")
    return 0


def _constitution_schema(args: argparse.Namespace) -> int:
    from kitchen.constitution import schema

    print(json.dumps(schema(args.kind), indent=2))
    return 0


def _world_sft_data(args: argparse.Namespace) -> int:
    from kitchen.scripted import SHIPPED_SFT_QUIRKS, SHIPPED_VARIANTS, write_sft_data

    _folder_to_write("--out", args.out)
    unsafe = (
        SHIPPED_SFT_QUIRKS.unsafe_check_first if args.unsafe_checks is None else args.unsafe_checks
    )
    stats = write_sft_data(
        args.out,
        n_train=args.train,
        n_eval=args.eval,
        seed=args.seed,
        long_share=args.long,
        quirks=SHIPPED_SFT_QUIRKS.model_copy(
            update={
                "style_draw": args.style_draw,
                "unsafe_check_first": unsafe,
                "skip_allergen_check": (
                    SHIPPED_SFT_QUIRKS.skip_allergen_check
                    if args.skip_checks is None
                    else args.skip_checks
                ),
            }
        ),
        variants=SHIPPED_VARIANTS if args.variants is None else args.variants,
        drills=args.drills,
        rename=args.rename,
    )
    for name in ("train", "eval"):
        s = stats[name]
        print(
            f"{args.out}/{name}.jsonl: {s['dialogues']} dialogues "
            f"({s['long']['dialogues']} meals), scripted success "
            f"{s['success']:.1%}, {s['assistant_turns']:.1f} assistant turns each"
        )
    if args.drills:
        print(f"{args.out}/train.jsonl: + {args.drills} check drills after the dialogues")
    print(f"{args.out}/stats.json: per-clause pass rates, short and long tasks apart")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from kitchen.sft import sft_main

    return sft_main(args.recipe, resume=args.resume)


def _grm_train(args: argparse.Namespace) -> int:
    from kitchen.calibrate import grm_train_main

    return grm_train_main(args.recipe, resume=args.resume)


def _grm_calibrate(args: argparse.Namespace) -> int:
    from kitchen.calibrate import TEMPERATURES, grm_calibrate_main

    return grm_calibrate_main(
        grm=args.grm,
        n=args.n,
        votes=args.votes,
        labels=args.labels,
        out=args.out,
        temperatures=args.temperatures or TEMPERATURES,
        perturb=args.perturb,
        cascade=args.cascade,
        seed=args.seed,
    )


def _temperatures(text: str) -> list[float]:
    """An argparse `type`: comma-separated sampling temperatures in (0, 2]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0.3,0.7, got {text!r}") from None
    if not values or any(not 0 < v <= 2 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be in (0, 2], got {text!r}")
    return values


def _clauses(text: str) -> list[str]:
    """An argparse `type`: comma-separated clause ids (checked against the constitution later)."""
    ids = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in ids if not x.isalnum()]
    if bad:
        raise argparse.ArgumentTypeError(f"not a clause id: {bad[0]!r} (e.g. T3,T6)")
    return ids


def _eval(args: argparse.Namespace) -> int:
    from kitchen.evaluate import eval_main

    return eval_main(
        args.policy,
        baseline=args.baseline,
        tasks=args.tasks,
        samples=args.samples,
        seed=args.seed,
        long_share=args.long,
        guard=args.guard,
        out=args.out,
        profile_swap_n=args.profile_swap,
    )


def _cook(args: argparse.Namespace) -> int:
    from kitchen.train import cook_main

    return cook_main(args.recipe, resume=args.resume)


def _schema(args: argparse.Namespace) -> int:
    from kitchen import constitution, sft, train

    make = {
        "constitution": lambda: constitution.schema("constitution"),
        "profile": lambda: constitution.schema("profile"),
        "sft-recipe": sft.schema,
        "recipe": train.recipe_schema,
    }[args.kind]
    print(json.dumps(make(), indent=2))
    return 0


def _scale(args: argparse.Namespace) -> int:
    if args.engine == "files":
        from kitchen.integrations.launch import write_files

        for p in write_files(args.rest[0] if args.rest else None):
            print(p)
        return 0
    if args.engine == "trl":
        from kitchen.integrations.trl import main as trl_main

        return trl_main(args.rest)
    from kitchen.integrations.verl import main as verl_main

    return verl_main(args.rest)


def _report(args: argparse.Namespace) -> int:
    from kitchen.report import run_report

    if args.out:
        _file_to_write("--out", args.out)
    print(run_report(args.run, args.out))
    return 0


def _tour(args: argparse.Namespace) -> int:
    from kitchen.walkthrough import constitution_walkthrough

    print(constitution_walkthrough())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kitchen import paths
    from kitchen.demo import main_job, summary

    seeds = args.seeds or [0]
    shipped = paths.RECIPES / "tiny_mapo.yaml"
    recipe = Path(args.recipe) if args.recipe else shipped
    own = recipe.resolve() == shipped.resolve()
    name = "demo" if own else f"demo-{recipe.stem.replace('_', '-')}"
    out_name = name if seeds == [0] else f"{name}-seeds"
    results = main_job(
        iterations=args.iterations,
        eval_tasks=args.eval_tasks,
        eval_samples=args.eval_samples,
        recipe=recipe,
        seeds=seeds,
        out_name=out_name,
        half_runs=args.half_runs,
    )
    print(summary(results, out_name))
    return 0


def _seeds(text: str) -> list[int]:
    """An argparse `type`: comma-separated seeds, e.g. 0,1,2."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 0,1,2, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must be distinct whole numbers >= 0: {text!r}")
    return seeds


Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kitchen", description="Constitution-aligned agent RL: constitutions, GRM, MAPO."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    con = sub.add_parser("constitution", help="validate, personalise and describe constitutions")
    csub = con.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = csub.add_parser("validate", help="check constitution files; exit 2 on any problem")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.set_defaults(func=_constitution_validate)
    p = csub.add_parser("personalize", help="print the personal constitution for a profile")
    p.add_argument("path", metavar="PATH", help="constitution YAML")
    p.add_argument("--profile", required=True, metavar="PROFILE", help="profile YAML")
    p.add_argument("--format", choices=["yaml", "text", "json"], default="yaml")
    p.set_defaults(func=_constitution_personalize)
    p = csub.add_parser("tour", help="a printed walk through the constitution stage")
    p.set_defaults(func=_tour)
    p = csub.add_parser("schema", help="print the JSON schema (for editor completion)")
    p.add_argument("--kind", choices=["constitution", "profile"], default="constitution")
    p.set_defaults(func=_constitution_schema)

    world = sub.add_parser("world", help="the concierge world: synthetic dialogue data")
    wsub = world.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = wsub.add_parser("sft-data", help="write scripted SFT dialogues (train and held-out eval)")
    p.add_argument("--out", default="data/sft", help="output folder (default data/sft)")
    p.add_argument(
        "--train", type=count(1, 1_000_000), default=4000, help="training dialogues (default 4000)"
    )
    p.add_argument(
        "--eval", type=count(1, 1_000_000), default=200, help="held-out dialogues (default 200)"
    )
    p.add_argument("--seed", type=count(0, 2**32 - 1), default=0)
    p.add_argument(
        "--long",
        type=fraction,
        default=0.5,
        metavar="SHARE",
        help="share of dialogues that are multi-course meals (long tasks; default 0.5)",
    )
    p.add_argument(
        "--style-draw",
        choices=["episode", "course"],
        default="episode",
        help="draw the agent's attentiveness to the diner's style once per episode (default) or "
        "again at every course of a meal",
    )
    p.add_argument(
        "--unsafe-checks",
        type=fraction,
        default=None,
        metavar="SHARE",
        help="share of an allergic diner's courses where the agent first checks a dish holding "
        "one of the diner's allergens and moves on (default: the shipped data's, 1)",
    )
    p.add_argument(
        "--variants",
        type=fraction,
        default=None,
        metavar="SHARE",
        help="share of training dialogues played for synthetic diners drawn around the training "
        "profiles, so allergy lists vary (never a held-out diner's set; default: the shipped "
        "data's, 0.5)",
    )
    p.add_argument(
        "--rename",
        type=fraction,
        default=0.0,
        metavar="SHARE",
        help="share of training dialogues whose dishes get invented names (the same all through "
        "the dialogue), so a name must be copied from the search or check that named it, not "
        "recalled (default 0)",
    )
    p.add_argument(
        "--skip-checks",
        type=fraction,
        default=None,
        metavar="SHARE",
        help="share of courses where the agent recommends a dish without checking its "
        "allergens (T1; default: the shipped data's, 0.15)",
    )
    p.add_argument(
        "--drills",
        type=count(0, 1_000_000),
        default=0,
        metavar="N",
        help="add N check drills to the training dialogues: allergic diners' single-dish "
        "dialogues cut after the turn that follows their last allergen check (default 0)",
    )
    p.set_defaults(func=_world_sft_data)

    p = sub.add_parser("sft", help="supervised fine-tuning from a recipe (the cold start)")
    p.add_argument("recipe", metavar="RECIPE", help="SFT recipe YAML, e.g. recipes/sft_tiny.yaml")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.set_defaults(func=_sft)

    grm = sub.add_parser("grm", help="train and calibrate the generative reward model")
    gsub = grm.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = gsub.add_parser("train", help="build judge-labelled review data and train the GRM")
    p.add_argument("recipe", metavar="RECIPE", help="GRM recipe YAML, e.g. recipes/grm_tiny.yaml")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.set_defaults(func=_grm_train)
    p = gsub.add_parser("calibrate", help="GRM vs judge (and human labels): the calibration report")
    p.add_argument("--grm", default=None, help="GRM checkpoint (default: the shipped tiny GRM)")
    p.add_argument(
        "--n", type=count(1, 100_000), default=200, help="held-out trajectories (default 200)"
    )
    p.add_argument(
        "--votes",
        type=count(1, 16),
        default=5,
        help="samples per vote in the voting comparison (default 5; 1: no voting)",
    )
    p.add_argument(
        "--temperatures",
        type=_temperatures,
        default=None,
        help="temperatures to vote at (default: calibrate.TEMPERATURES, 0.3,0.7,1.0)",
    )
    p.add_argument(
        "--perturb",
        type=count(0, 10_000),
        default=24,
        help="dialogues given the held-out rewordings and attacks (default 24; 0: skip)",
    )
    p.add_argument(
        "--cascade",
        type=_clauses,
        default=[],
        help="clauses the rule judge decides, reported beside the GRM alone (e.g. T3,T6)",
    )
    p.add_argument("--seed", type=count(0), default=4242, help="held-out set seed (default 4242)")
    p.add_argument("--labels", default=None, help="human labels folder (default data/labels)")
    p.add_argument("--out", default=None, help="also write the report as JSON here")
    p.set_defaults(func=_grm_calibrate)

    p = sub.add_parser(
        "eval", help="play held-out tasks and profiles with a policy; judge by rules; print a table"
    )
    p.add_argument("--policy", required=True, metavar="PATH", help="policy checkpoint folder")
    p.add_argument(
        "--baseline",
        metavar="PATH",
        default=None,
        help="also play this policy on the same seeds and report the win rate",
    )
    p.add_argument("--tasks", type=int, default=None, help="held-out tasks (default 30)")
    p.add_argument(
        "--samples", type=int, default=None, help="episodes per task and profile (default 2)"
    )
    p.add_argument("--seed", type=int, default=None, help="seed (default 1234)")
    p.add_argument(
        "--long",
        type=float,
        default=None,
        metavar="SHARE",
        help="share of the held-out tasks that are meals (long tasks; default 0)",
    )
    p.add_argument(
        "--guard", action="store_true", help="also play the policy behind the axiom guard"
    )
    p.add_argument("--out", default=None, metavar="FILE", help="also write the report as JSON")
    p.add_argument(
        "--profile-swap",
        type=int,
        default=None,
        metavar="N",
        help="also: on the first N held-out SFT dialogues, the words of each policy's first "
        "recommendation with only the diner's verbosity changed (does it read the profile?)",
    )
    p.set_defaults(func=_eval)

    p = sub.add_parser("cook", help="run a training recipe: rollouts, GRM, buffer, MAPO, eval")
    p.add_argument("recipe", nargs="?", metavar="RECIPE", help="recipe YAML (recipes/*.yaml)")
    p.add_argument(
        "--resume",
        metavar="RUN",
        default=None,
        help="continue the run in this folder (runs/<name>) from its last checkpoint",
    )
    p.set_defaults(func=_cook)

    p = sub.add_parser("scale", help="beyond one GPU: TRL and verl (see recipes/scale/README.md)")
    p.add_argument(
        "engine",
        choices=["trl", "verl", "files"],
        help="trl: train a recipe with TRL's GRPOTrainer (--recipe F ...); verl: write "
        "a recipe's task pool for verl (data --recipe F --out D); files: regenerate "
        "the launch files in recipes/scale/",
    )
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the engine")
    p.set_defaults(func=_scale)

    p = sub.add_parser("report", help="write a self-contained HTML report of a training run")
    p.add_argument("run", metavar="RUN", help="run folder, e.g. runs/tiny-mapo")
    p.add_argument("--out", default=None, help="output file (default RUN/report.html)")
    p.set_defaults(func=_report)

    p = sub.add_parser("schema", help="print a JSON schema (for editor completion of YAML)")
    p.add_argument("kind", choices=["constitution", "profile", "recipe", "sft-recipe"])
    p.set_defaults(func=_schema)

    p = sub.add_parser("demo", help="the main job: MAPO and GRPO runs, evaluation, HTML report")
    p.add_argument(
        "--iterations",
        type=count(1),
        default=None,
        help="iterations per run (default: the recipes' own)",
    )
    p.add_argument(
        "--eval-tasks",
        type=count(1, 10_000),
        default=100,
        help="held-out tasks, about half of them meals (default 100: with 2 samples, the 200 "
        "episodes a win-rate interval needs)",
    )
    p.add_argument(
        "--eval-samples",
        type=count(1, 16),
        default=2,
        help="episodes per held-out task and diner (default 2)",
    )
    p.add_argument(
        "--seeds",
        type=_seeds,
        default=None,
        help="run MAPO and GRPO for each of these seeds (e.g. 0,1,2): the multi-seed figure, "
        "written to runs/demo-seeds/ (default: seed 0 only, runs/demo/)",
    )
    p.add_argument(
        "--half-runs",
        action="store_true",
        help="measure sample efficiency with a MAPO run trained on half the budget, one more "
        "run per seed (about a quarter more training time); default: the MAPO run's own "
        "checkpoint at half its iterations, which is mid-way down its learning-rate schedule",
    )
    p.add_argument(
        "--recipe",
        default=None,
        help="the MAPO recipe, with a `compare: grpo` arm; its policy is the SFT baseline "
        "(default recipes/tiny_mapo.yaml; another one writes runs/demo-<its name>/)",
    )
    p.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KitchenError as e:
        for p in e.problems:
            print(p, file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kitchen ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
