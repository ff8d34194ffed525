"""Write the embedded judge set as judge_train.json, judge_val.json and judge_test.json (the --data_dir format).

    python data/make_judge_set.py out/judge_data            # then: python judge_train_mps.py --data_dir out/judge_data
    python data/make_judge_set.py out/judge_data --seed 1   # another draw of the same task

The judge scripts generate the same set in memory when --data_dir is not given (judge_train_mps.py,
embedded_judge_set); this script is for reading it, editing it, or using it as a template for
your own data: each file is a list of {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}.
The assistant's answer must hold its score as `Score: X/10` (X from 0 to 10), anywhere in the text:
the embedded set writes the feedback first and the score on the last line, the order a judge learns
best (reasoning, then verdict); answers with the score first are read the same way.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import judge_train_mps as judge  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out_dir", help="directory to write the three JSON files into")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw (the scripts use 0)")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    for split, records in judge.embedded_judge_set(args.seed).items():
        path = judge.split_path(args.out_dir, split)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(records, f, ensure_ascii=False, indent=1)
        print(f"wrote {len(records)} conversations to {path}")


if __name__ == "__main__":
    main()
