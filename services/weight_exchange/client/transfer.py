"""One planned copy of a region from a sender's local tensor to a receiver's local tensor."""

from __future__ import annotations

import dataclasses

from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.weight_exchange.client.layout import region_from_proto, region_to_proto
from services.weight_exchange.client.regions import Region

# The planner's default bucket: the receiver stages at most this much of one link at a time (the trainer's memory
# plan counts two of them on an accelerator)
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Transfer:
    src: str
    dst: str
    canonical_name: str
    src_local: str
    src_region: Region
    dst_local: str
    dst_region: Region
    num_bytes: int
    bucket: int = 0
    dtype: str = ""  # wire dtype (the sender's)

    def to_proto(self) -> wx_pb2.Transfer:
        return wx_pb2.Transfer(
            src_rank_id=self.src, dst_rank_id=self.dst, canonical_name=self.canonical_name,
            src_local_name=self.src_local, src_region=region_to_proto(self.src_region),
            dst_local_name=self.dst_local, dst_region=region_to_proto(self.dst_region),
            num_bytes=self.num_bytes, bucket=self.bucket, dtype=self.dtype)

    def to_row(self) -> list:
        """A JSON-able row (a worker process that takes plain strings, e.g. through vLLM's /collective_rpc)."""
        return [self.src, self.dst, self.canonical_name, self.src_local, list(self.src_region.offsets),
                list(self.src_region.sizes), self.dst_local, list(self.dst_region.offsets),
                list(self.dst_region.sizes), self.num_bytes, self.bucket, self.dtype]

    @classmethod
    def from_row(cls, row: list) -> Transfer:
        src, dst, name, src_local, so, ss, dst_local, do, ds, num_bytes, bucket, dtype = row
        return cls(src, dst, name, src_local, Region(tuple(so), tuple(ss)), dst_local, Region(tuple(do), tuple(ds)),
                   int(num_bytes), int(bucket), dtype)

    @classmethod
    def from_proto(cls, pb: wx_pb2.Transfer) -> Transfer:
        return cls(pb.src_rank_id, pb.dst_rank_id, pb.canonical_name, pb.src_local_name,
                   region_from_proto(pb.src_region), pb.dst_local_name, region_from_proto(pb.dst_region),
                   pb.num_bytes, pb.bucket, pb.dtype)
