#!/usr/bin/env python3
"""`moecore export-hf` tokenizer files, checked with the pinned Python `tokenizers` library.

1. The embedded corpus's byte-level vocabulary: the exported tokenizer.json loads in `tokenizers`,
   its encode gives moecore's byte ids (those of `moecore tokenize`, EOS aside), decode gives the
   text back, <|endoftext|> is the run's EOS id, and moecore's own tokenizer (`moecore data
   prepare`) reads the file to the same ids; tokenizer_config.json / special_tokens_map.json name
   the EOS.
2. A tokenizer.json given with --tokenizer (and one recorded as data.tokenizer) is copied byte for
   byte, with the tokenizer_config.json beside it; one with more ids than the model is refused.
3. Where `transformers` imports (--transformers-path DIR, or on the path): AutoTokenizer.from_pretrained
   on each export gives the same ids as `tokenizers`, its eos_token_id is the run's EOS, and
   decode gives the text back. Without transformers (CI) that part is reported as not run and the
   files it reads are checked field by field above.
Exit 77 (CTest: skipped) when `tokenizers` cannot be imported.
Usage: check_tokenizer_export.py --moecore BIN [--pythonpath DIR] [--transformers-path DIR]
"""
import argparse
import array
import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SKIP = 77
TEXTS = [
    "The cat sat on the mat.\n",
    "12 + 30 = 42; counting: 1 2 3 4 5",
    "  leading spaces, trailing\t\ttabs   ",
    "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F600",
    "control \x01\x07\x1b[0m \x7f bytes",
    "line one\r\nline two\n\n",
    "a",
]
MODEL = ["--model.dense_layers=[]", "--moe.shared_experts=0", "--moe.norm_topk_prob=true", "--model.d_model=32",
         "--model.n_layers=2", "--moe.expert_hidden=16", "--moe.num_experts=4", "--train.seq_len=16",
         "--train.micro_batch=2", "--train.global_batch=2", "--train.steps=1", "--train.eval_interval=0"]


def read_u16(path):
    a = array.array("H")
    a.frombytes(Path(path).read_bytes())
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def read_npy(path):
    """The ids of a little-endian uint16/uint32 .npy file (moecore data prepare's output)."""
    raw = Path(path).read_bytes()
    assert raw[:6] == b"\x93NUMPY", f"{path}: not a .npy file"
    hlen, start = (int.from_bytes(raw[8:10], "little"), 10) if raw[6] == 1 else (int.from_bytes(raw[8:12], "little"), 12)
    header = ast.literal_eval(raw[start:start + hlen].decode("latin1"))
    a = array.array({"<u2": "H", "<u4": "I"}[header["descr"]])
    a.frombytes(raw[start + hlen:])
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def run(cmd, expect=0):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != expect:
        sys.exit(f"command exited {r.returncode}, expected {expect}: {' '.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


def check(ok, what, failures):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moecore", required=True)
    ap.add_argument("--pythonpath")
    ap.add_argument("--transformers-path", help="a folder holding transformers (tried after --pythonpath)")
    args = ap.parse_args()
    if args.pythonpath:
        sys.path.insert(0, args.pythonpath)
    if args.transformers_path:
        sys.path.insert(0, args.transformers_path)
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    except ImportError as e:
        print(f"skipped: {e}")
        return SKIP
    binary = args.moecore
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # 1. The byte-level vocabulary of the embedded default.
        run([binary, "train", f"--run.dir={work / 'run'}", *MODEL])
        out = run([binary, "export-hf", work / "run" / "checkpoints", work / "hf", "--dtype", "fp32"])
        check("byte-level vocabulary" in out, "export-hf names the byte-level tokenizer", failures)
        hf = work / "hf"
        tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
        eos = tok.token_to_id("<|endoftext|>")
        check(eos == 0, f"<|endoftext|> is id 0 (the embedded EOS), got {eos}", failures)
        for i, text in enumerate(TEXTS):
            ids = tok.encode(text, add_special_tokens=False).ids
            want = list(text.encode("utf-8"))
            check(ids == want, f"text {i}: tokenizers' ids are the bytes", failures)
            check(tok.decode(ids, skip_special_tokens=False) == text, f"text {i}: decode gives the text back", failures)
            src = work / f"t{i}.txt"
            src.write_bytes(text.encode("utf-8"))
            run([binary, "tokenize", "--out", work / f"t{i}.bin", src])
            moe_ids = read_u16(work / f"t{i}.bin")
            check(moe_ids == ids + [eos], f"text {i}: `moecore tokenize` ids (+ EOS) equal tokenizers'", failures)
        check(tok.encode("x<|endoftext|>y", add_special_tokens=False).ids == [ord("x"), 0, ord("y")],
              "<|endoftext|> in text is the EOS id", failures)
        # moecore's own tokenizer reads the exported file to the same ids.
        (work / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
        out = run([binary, "data", "prepare", "--tokenizer", hf / "tokenizer.json", "--out", work / "prep",
                   "--jobs", "1", work / "docs.jsonl"])
        got = read_npy(work / "prep" / "docs.npy")
        want = [i for t in TEXTS for i in list(t.encode("utf-8")) + [0]]
        check(got == want, "moecore data prepare with the exported tokenizer.json gives bytes + EOS 0", failures)
        cfg = json.loads((hf / "tokenizer_config.json").read_text())
        check(cfg.get("eos_token") == "<|endoftext|>" and cfg.get("bos_token") is None
              and cfg.get("tokenizer_class") == "PreTrainedTokenizerFast"
              and cfg.get("added_tokens_decoder", {}).get("0", {}).get("content") == "<|endoftext|>",
              "tokenizer_config.json: eos <|endoftext|>, no bos, PreTrainedTokenizerFast", failures)
        stm = json.loads((hf / "special_tokens_map.json").read_text())
        check(stm == {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, "special_tokens_map.json", failures)
        hfc = json.loads((hf / "config.json").read_text())
        check(hfc.get("eos_token_id") == eos, "config.json eos_token_id is the tokenizer's EOS", failures)

        # 2. A trained byte-level BPE tokenizer given with --tokenizer, and recorded as data.tokenizer.
        def bpe(vocab, where):
            t = Tokenizer(models.BPE())
            t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            t.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
            t.train_from_iterator(TEXTS * 20, trainer)
            where.mkdir()
            t.save(str(where / "tokenizer.json"))
            return t
        big = bpe(300, work / "tok300")
        check(big.get_vocab_size() > 257, "the trained tokenizer has merges", failures)
        out = run([binary, "export-hf", work / "run" / "checkpoints", work / "hf_refused", "--tokenizer",
                   work / "tok300" / "tokenizer.json"], expect=1)
        check("has ids up to" in out and "model.vocab_size = 256" in out, "a tokenizer larger than the model is refused",
              failures)
        run([binary, "train", f"--run.dir={work / 'run512'}", "--model.vocab_size=512",
             f"--data.tokenizer={work / 'tok300' / 'tokenizer.json'}", *MODEL])
        (work / "tok300" / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", '
                                                               '"eos_token": "<|endoftext|>", "marker": 1}\n')
        for name, extra in (("given", ["--tokenizer", work / "tok300" / "tokenizer.json"]), ("recorded", [])):
            d = work / f"hf_{name}"
            run([binary, "export-hf", work / "run512" / "checkpoints", d, *extra])
            same = (d / "tokenizer.json").read_bytes() == (work / "tok300" / "tokenizer.json").read_bytes()
            check(same, f"{name}: tokenizer.json copied byte for byte", failures)
            check(json.loads((d / "tokenizer_config.json").read_text()).get("marker") == 1,
                  f"{name}: tokenizer_config.json beside it copied", failures)
            check(json.loads((d / "special_tokens_map.json").read_text()).get("eos_token") == "<|endoftext|>",
                  f"{name}: special_tokens_map.json written with the EOS", failures)
            back = Tokenizer.from_file(str(d / "tokenizer.json"))
            check(back.encode(TEXTS[0]).ids == big.encode(TEXTS[0]).ids, f"{name}: the copy encodes as the original",
                  failures)

        # 3. AutoTokenizer on the exports, where transformers is installed.
        try:
            import transformers
            from transformers import AutoTokenizer
        except ImportError as e:
            auto = f"not run (transformers: {e})"
        else:
            for d, reference, eos_id in ((hf, tok, eos), (work / "hf_given", big, big.token_to_id("<|endoftext|>"))):
                at = AutoTokenizer.from_pretrained(str(d))
                check(at.eos_token_id == eos_id, f"{d.name}: AutoTokenizer eos_token_id {at.eos_token_id} == {eos_id}",
                      failures)
                for i, text in enumerate(TEXTS):
                    ids = at(text, add_special_tokens=False)["input_ids"]
                    check(ids == reference.encode(text, add_special_tokens=False).ids,
                          f"{d.name} text {i}: AutoTokenizer ids equal tokenizers'", failures)
                    check(at.decode(ids) == text, f"{d.name} text {i}: AutoTokenizer decode gives the text back",
                          failures)
            auto = f"AutoTokenizer checked (transformers {transformers.__version__})"
        print(auto)
    print(json.dumps({"failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
