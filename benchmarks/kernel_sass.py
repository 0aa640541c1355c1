"""Compiles the fused HSTU attention kernels for an H100/H200 (sm_90) on any machine, GPU or not, and prints
per kernel its registers per thread, stack (spills), shared memory, instruction count and the loops and
branches of its SASS: how many instructions a tile costs, before any GPU time is spent on timing it.

    pip install --target /tmp/triton36 --no-deps triton==3.6.0    # the GPU machine's Triton: the same code
    PYTHONPATH=/tmp/triton36 python benchmarks/kernel_sass.py lightning_hstu/kernels/hstu_attention.py
    PYTHONPATH=/tmp/triton36 python benchmarks/kernel_sass.py FILE --config "fwd:num_warps=8,maxnreg=128"

The file is a copy of ``lightning_hstu/kernels/hstu_attention.py`` (as ``kernel_ab.py`` takes them). The
launch is the bf16 one of a model with heads of 128 (``--dim 256``: of 256): the kernel's own
``kernel_configs``, pointers and integer arguments aligned to 16 bytes (as Triton specialises them for the
real tensors), TMA descriptors where the file's kernels load through them (the forward's keys and values,
the dk/dv kernel's queries and output gradients, the stored score gradients), no distance clamp; ``dq`` is
the kernel the configs launch (``_hstu_bwd_dq_stored`` where they store the score gradients). Triton's
compiler and the ptxas it ships produce the same SASS as on the GPU machine when the Triton version is the
same (3.6.0 there: checked against Nsight Compute's listing of the forward, 3864 instructions both). Loops
are the backward branches; each line gives the instructions between the branch and its target."""

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import torch
import triton
from kernel_ab import load
from triton.backends.compiler import GPUTarget

POINTERS = {
    "Q": "*bf16",
    "K": "*bf16",
    "V": "*bf16",
    "Out": "*bf16",
    "dOut": "*bf16",
    "dQ": "*bf16",
    "dK": "*bf16",
    "dV": "*bf16",
    "offsets": "*i64",
    "timestamps": "*i64",
    "ranges": "*i64",
    "position_table": "*fp32",
    "time_table": "*fp32",
    "PQ": "*bf16",  # the pre-activations whose SiLU q, k and v are (``projected_attention(silu=True)``)
    "PK": "*bf16",
    "PV": "*bf16",
    "U_GRAD": "*bf16",  # U's gradient, which the dk/dv kernel copies into its columns of the projection's (dU)
    "dU": "*bf16",
    "d_position": "*fp32",
    "d_time": "*fp32",
    "ds_rows": "*i32",  # kernel files that placed the stored sequences by a table of rows
    "order": "*i32",  # the sequences' indices by length (``ORDER="sequences"``)
}
KERNELS = {
    "fwd": "_hstu_fwd",
    "dkdv": "_hstu_bwd_dkdv",
    "dq": "_hstu_bwd_dq",
    "dk": "_hstu_bwd_dk_stored",
    "time": "_hstu_bwd_time_stored",
    "bands": "_hstu_bwd_position_bands",
}
STORED_DQ = "_hstu_bwd_dq_stored"  # the dq kernel where the configs store the score gradients (``store_ds``)
DESCRIPTORS = {
    "fwd": {"K": "BLOCK_N", "V": "BLOCK_N"},
    "dkdv": {"Q": "BLOCK_M", "dOut": "BLOCK_M"},
    "dq": {"K": "BLOCK_N", "V": "BLOCK_N"},
    "dk": {"Q": "BLOCK_M"},
    "time": {},
    "bands": {},
}


def instructions(sass: str) -> list[tuple[int, str]]:
    found = []
    for line in sass.splitlines():
        match = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if match:
            found.append((int(match.group(1), 16), match.group(2).strip()))
    return found


def branches(code: list[tuple[int, str]]) -> list[str]:
    """Each branch with a target: its address, target and the instructions in between."""
    addresses = [address for address, _ in code]
    lines = []
    for address, text in code:
        if "BRA" not in text or "BRA.DIV" in text:
            continue
        target = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        if not target:
            continue
        target = int(target.group(1), 16)
        if target == address:
            continue
        low, high = min(address, target), max(address, target)
        span = sum(1 for a in addresses if low <= a < high)
        kind = "loop back" if target < address else "skips"
        lines.append(f"    {address:#07x} {kind} to {target:#07x}: {span} instructions")
    return lines


def opcode_counts(code: list[tuple[int, str]]) -> collections.Counter:
    counts = collections.Counter()
    for _, text in code:
        tokens = text.split()
        opcode = tokens[1] if tokens[0].startswith("@") and len(tokens) > 1 else tokens[0]
        counts[opcode.split(".")[0]] += 1
    return counts


def compile_kernel(module, kind: str, config: dict, configs: dict, dim: int = 128):
    store = bool(configs.get("store_ds"))
    fn = getattr(module, STORED_DQ if kind == "dq" and store else KERNELS[kind])
    config = dict(config)
    options = {key: config.pop(key) for key in ("num_warps", "num_stages", "maxnreg") if key in config}
    constants = dict(
        ATTENTION_DIM=dim,
        HIDDEN_DIM=dim,
        BLOCK_A=dim,
        BLOCK_D=dim,
        PRECISION="tf32",
        FAST=True,
        CLAMP=False,
        RANGE_BLOCK=module.range_block(configs) if hasattr(module, "range_block") else None,  # older files: none
        SKEW=triton.next_power_of_2(config["BLOCK_M"] + config["BLOCK_N"] - 1),
        TIME_BLOCK=64,
        STORE_DS=store,
        STORE_S=bool(configs.get("store_s")),  # the forward stores the scores, the dk/dv kernel reads them
        SCORES_STORED=bool(configs.get("store_s")),
        DK=kind == "dk" or not configs.get("dk"),  # the dk/dv kernel accumulates dk unless a dk kernel does
        TIME={"dk": configs.get("time") == "dk", "bands": configs.get("time") == "bands"}.get(
            kind, configs.get("time") is None
        ),  # where the time sums are
        POSITIONS=not configs.get("bands"),  # the stored dq kernel's position sums, unless by bands
        **({} if store else {"DS": None, "ds_rows": None, "ds_side": None}),  # not stored: None for them
        **({} if configs.get("store_s") else {"S": None, "s_side": None, "s_head_rows": None}),
        **{"BIAS_GRADS": configs["bias_grads"] == kind, "ORDER": "index", **config},  # --config may name them
    )
    constants = {name: value for name, value in constants.items() if name in fn.arg_names}
    signature, attrs = {}, {}
    source = inspect.getsource(module)
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in DESCRIPTORS[kind] and f"{name}.load(" in source:  # TMA descriptors of [tokens, heads, dim]
            signature[name] = f"tensordesc<bf16[{config[DESCRIPTORS[kind][name]]}, 1, {dim}]>"
        elif name in ("DS", "S"):  # the stored score gradients (the forward: scores), [keys, queries] tiles
            signature[name] = f"tensordesc<bf16[{config['BLOCK_N']}, {config['BLOCK_M']}]>"
        else:
            signature[name] = POINTERS.get(name, "i32")
            attrs[(index,)] = [["tt.divisibility", 16]]
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    source = triton.compiler.ASTSource(fn=fn, constexprs=constants, signature=signature, attrs=attrs)
    return triton.compile(source, target=target, options=backend.parse_options(options).__dict__)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="a copy of lightning_hstu/kernels/hstu_attention.py")
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), help="default: those the configs launch")
    parser.add_argument("--config", default="", help='overrides, e.g. "fwd:num_warps=8,maxnreg=128;dq:BLOCK_N=64"')
    parser.add_argument("--dump", help="a folder for each kernel's SASS and Triton GPU IR")
    parser.add_argument("--dim", type=int, default=128, choices=[64, 128, 256], help="heads' width (q, k, v)")
    args = parser.parse_args()
    module = load(args.file)
    configs = module.kernel_configs(args.dim, args.dim, torch.bfloat16, torch.device("cuda"))
    for item in filter(None, args.config.split(";")):
        kind, settings = item.split(":")
        for setting in settings.split(","):
            key, value = setting.split("=")
            configs[kind][key] = int(value)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    print(f"# triton {triton.__version__}, sm_90")
    for kind in args.kernels or [kind for kind in KERNELS if isinstance(configs.get(kind), dict)]:
        compiled = compile_kernel(module, kind, configs[kind], configs, args.dim)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "kernel.cubin")
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path], capture_output=True, text=True)
            usage = subprocess.run(
                [os.path.join(tools, "cuobjdump"), "-res-usage", path], capture_output=True, text=True
            )
        registers = re.search(r"REG:(\d+)", usage.stdout).group(1)
        stack = re.search(r"STACK:(\d+)", usage.stdout).group(1)
        code = instructions(sass.stdout)
        print(
            f"\n{kind} {configs[kind]}: {registers} registers, stack {stack} bytes, shared "
            f"{compiled.metadata.shared} bytes, {len(code)} instructions"
        )
        print("    " + " ".join(f"{op} {n}" for op, n in opcode_counts(code).most_common(16)))
        print("\n".join(branches(code)))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"{kind}.sass"), "w") as f:
                f.write(sass.stdout)
            with open(os.path.join(args.dump, f"{kind}.ttgir"), "w") as f:
                f.write(compiled.asm["ttgir"])


if __name__ == "__main__":
    main()
