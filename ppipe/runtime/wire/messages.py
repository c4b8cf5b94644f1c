"""The data path's message types: what the scheduler's host and the workers send each other.

Every message is a :class:`msgspec.Struct` encoded as a MessagePack array (``array_like``:
no field names on the wire) and decoded by :func:`ppipe.runtime.wire.frames.unpack` into
the one type its receiver expects, so a message with a missing field, a field of the wrong
type or an unknown kind is refused at decoding (:class:`~ppipe.runtime.wire.frames.WireError`),
never half-read. Tensors are not fields: they follow the message as raw frames
(:mod:`ppipe.runtime.wire.frames`).

A batch's life on the data path:

1. The host sends :class:`StageMsg` with ``stage=0`` and the batch's inputs to the first
   worker of the route (and, for every stage that receives over an NCCL or ring edge, a
   :class:`StageMsg` of that stage without tensors: both ends of an edge are posted at once).
2. Worker k runs its partition and sends :class:`StageMsg` with ``stage=k+1`` and its fp16
   output to worker k+1 (unless the edge carries them), and a :class:`StageReport` to the
   host, or lets the report ride on in ``carried`` when the stage ran as reserved
   (:func:`ppipe.dataplane.feedback.ran_as_reserved`).
3. The last worker's :class:`StageReport` carries the model's outputs as its tensors.

Times are wall-clock microseconds (the workers' and the host's clocks; the host converts
them to the scheduler's timeline).

Evolution rule: a new field gets a default and goes last, so a peer of the previous
version still decodes what it knows (msgspec fills the default where the array is short).
"""

from __future__ import annotations

import msgspec

STRUCT = dict(array_like=True, frozen=True, gc=False, omit_defaults=True)


class EdgeRef(msgspec.Struct, **STRUCT):
    """One message on an NCCL or ring edge: number ``seq`` of the edge with ``peer`` opened by plan generation ``gen``."""

    peer: str
    seq: int
    gen: int = 0


class StageLinks(msgspec.Struct, **STRUCT):
    """A stage's edges: it sends its output as a message on ``send`` / takes its input from ``recv``."""

    send: EdgeRef | None = None
    recv: EdgeRef | None = None


class Reservation(msgspec.Struct, **STRUCT):
    """A stage's reservation in wall-clock us: its NIC transfer (``transfer_start_us`` None where
    it reserves none) and its run on the vGPU."""

    transfer_start_us: float | None
    transfer_us: float
    start_us: float
    end_us: float


class StageReport(msgspec.Struct, **STRUCT):
    """What really happened to one stage of a batch, in wall-clock us.

    ``error`` set: the stage failed (its stamps are 0). ``carried``: the reports of earlier
    stages that ran as reserved and rode on to this one, in stage order.
    """

    batch_id: int
    stage: int
    vgpu_id: str
    start_us: float = 0.0
    end_us: float = 0.0
    transfer_start_us: float | None = None
    transfer_end_us: float | None = None
    received_us: float | None = None  # when the stage message reached the worker
    node_id: str | None = None
    error: str | None = None
    carried: tuple["StageReport", ...] = ()


class AnswerTo(msgspec.Struct, **STRUCT):
    """Where rows of a batch's outputs go: rows ``offset`` .. ``offset + len(rids) - 1`` answer
    requests ``rids`` of the ingress whose inbox is ``address`` (:class:`Answer`)."""

    address: str
    offset: int
    rids: tuple[int, ...]


class Seal(msgspec.Struct, **STRUCT):
    """The seal of a feature map in shared memory: 8 bytes at ``ref`` (a
    :class:`~ppipe.runtime.wire.shared_inputs.SharedRef`) that hold ``token`` while the map
    is the one sent (:mod:`ppipe.runtime.wire.handoff`)."""

    ref: tuple[int, int, int, int]
    token: int


class StageMsg(msgspec.Struct, **STRUCT):
    """Stage ``stage`` of batch ``batch_id``, with the whole route so each worker can forward.

    ``route``: the vGPU of every stage; ``addresses``: their data-path addresses;
    ``batch``: the batch's size; ``timing``: every stage's :class:`Reservation`;
    ``links``: every stage's :class:`StageLinks` (None: the route has no NCCL or ring edge);
    ``tolerance_us``: a stage within this of its reservation lets its report ride on
    (None: every stage reports at once); ``sent_us``: when the tensors left their sender
    (None on a message without tensors); ``carried``: the reports riding on.

    Where the batch's requests are held by ingress processes (:mod:`ppipe.runtime.ingress.remote`),
    each ingress sends stage 0 its own rows: ``part`` is ``(offset, rows)``, the rows of the
    inputs this message carries (the worker runs the batch once all ``batch`` rows are in),
    and ``answers`` says which ingress the last stage answers with which rows of the
    outputs (its report to the scheduler then carries none). ``part`` None: the message
    carries the whole batch (or no tensors); ``answers`` empty: the outputs go with the
    last report. ``seals``: where the tensors lie in the sender's shared memory, their
    :class:`Seal` each, which the receiver checks once its stage ran (:mod:`ppipe.runtime.wire.handoff`).
    """

    batch_id: int
    stage: int
    route: tuple[str, ...]
    addresses: tuple[str, ...]
    batch: int
    timing: tuple[Reservation, ...]
    links: tuple[StageLinks | None, ...] | None = None
    tolerance_us: float | None = None
    sent_us: float | None = None
    carried: tuple[StageReport, ...] = ()
    part: tuple[int, int] | None = None
    answers: tuple[AnswerTo, ...] = ()
    seals: tuple[Seal, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.route)
        if not (0 <= self.stage < n and len(self.addresses) == n and len(self.timing) == n):
            raise ValueError(f"stage {self.stage} of a route of {n} vGPUs, {len(self.addresses)} addresses and {len(self.timing)} reservations")
        if self.links is not None and len(self.links) != n:
            raise ValueError(f"{len(self.links)} links for a route of {n} vGPUs")
        if self.batch < 1:
            raise ValueError(f"batch of {self.batch}")
        if self.part is not None and not (0 <= self.part[0] and 1 <= self.part[1] and sum(self.part) <= self.batch):
            raise ValueError(f"part {self.part} of a batch of {self.batch}")
        if self.answers and sum(len(a.rids) for a in self.answers) != self.batch:
            raise ValueError(f"answers for {sum(len(a.rids) for a in self.answers)} rows of a batch of {self.batch}")


class Answer(msgspec.Struct, tag="answer", **STRUCT):
    """The last stage's outputs for some requests of an ingress (rows in ``rids``' order), as tensors."""

    batch_id: int
    rids: tuple[int, ...]


# ---- between ingress processes and the scheduler's host ---------------------------------------


class RowInput(msgspec.Struct, **STRUCT):
    """One input of a request as the scheduler may forward it to the first worker itself:
    ``name``, ``dtype`` (NumPy's ``dtype.str``), the sample's ``shape`` (no batch axis), and
    either ``ref``, where its bytes lie in the ingress's shared memory (a
    :class:`~ppipe.runtime.wire.shared_inputs.SharedRef`: pid, fd, serial, offset), or its
    bytes themselves (``data``, a small input)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    ref: tuple[int, int, int, int] | None = None
    data: bytes = b""


class Arrival(msgspec.Struct, **STRUCT):
    """A request (one sample) an ingress holds: its id there, its model, and when it arrived
    (wall-clock us). ``inputs``: every input as a :class:`RowInput`, where the scheduler may
    send them to the first worker itself (empty: the ingress sends them when told, :class:`SendInputs`)."""

    rid: int
    model: str
    arrival_us: float
    inputs: tuple[RowInput, ...] = ()


class FromIngress(msgspec.Struct, **STRUCT):
    """What an ingress tells the scheduler in one loop tick: new requests and withdrawn ones
    (the other samples of a request that was refused). ``hello``: the ingress's inbox
    address, on its first message. ``metrics``: its Prometheus text exposition, sent every
    second on a message of its own."""

    ingress: int
    arrivals: tuple[Arrival, ...] = ()
    withdrawn: tuple[int, ...] = ()
    hello: str | None = None
    metrics: bytes | None = None


class SendInputs(msgspec.Struct, **STRUCT):
    """Send these requests' inputs, stacked in this order, as ``stage`` (a stage-0 :class:`StageMsg`
    whose ``part`` names their rows) to the route's first worker."""

    stage: StageMsg
    rids: tuple[int, ...]


class Refusal(msgspec.Struct, **STRUCT):
    """These requests of an ingress will not be served (a drop, a failed worker, a timeout)."""

    rids: tuple[int, ...]
    reason: str
    detail: str = ""


class ServedPlan(msgspec.Struct, **STRUCT):
    """The plan a server serves, as its ingresses need it: the plan (its JSON) and each of its
    models' manifest (their JSON: inputs, outputs, preprocess), which the ingresses validate
    requests against. Sent at an ingress's hello and after each plan switch."""

    plan_json: bytes
    manifests_json: dict[str, bytes]


class ToIngress(msgspec.Struct, tag="down", **STRUCT):
    """What the scheduler tells an ingress in one loop tick: inputs to send, requests refused,
    and (when it changed) the models ready now. ``metrics``: the whole server's Prometheus
    text (the scheduler's and every ingress's, each sample labelled with its ``process``),
    sent every second, which the ingress's ``/metrics`` answers with. ``plan``: the plan
    served, at the ingress's hello and after each switch (the ingress takes it before it
    reads ``ready``).

    On a server of several schedulers (``--ingress N --shards K``): ``origin`` is the
    sender's shard, whose ``plan`` and ``ready`` these are; shard 0 also tells the
    ``schedulers`` (every shard's ingress inbox by index, ``""`` for one that is down) and
    the ``owner`` table (model -> ``(shard, weight)`` pairs) at the hello and whenever they
    change."""

    sends: tuple[SendInputs, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    ready: tuple[str, ...] | None = None
    metrics: bytes | None = None
    plan: ServedPlan | None = None
    origin: int = 0
    schedulers: tuple[str, ...] | None = None
    owner: dict[str, tuple[tuple[int, float], ...]] | None = None


IngressInbox = ToIngress | Answer
"""What an ingress's inbox receives: the scheduler's :class:`ToIngress` and the last workers' :class:`Answer`."""

