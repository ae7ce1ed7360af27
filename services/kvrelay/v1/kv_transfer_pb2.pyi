from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PullBlocksRequest(_message.Message):
    __slots__ = ("engine_id", "epoch", "request_id", "block_ids", "block_bytes", "handle_id", "requester_engine_id", "proof")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    handle_id: str
    requester_engine_id: str
    proof: bytes
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., handle_id: _Optional[str] = ..., requester_engine_id: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class NixlPeerInfo(_message.Message):
    __slots__ = ("agent_metadata", "agent_name", "base_address", "num_blocks", "block_bytes", "device_id", "mem_type")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    agent_name: str
    base_address: int
    num_blocks: int
    block_bytes: int
    device_id: int
    mem_type: str
    def __init__(self, agent_metadata: _Optional[bytes] = ..., agent_name: _Optional[str] = ..., base_address: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., device_id: _Optional[int] = ..., mem_type: _Optional[str] = ...) -> None: ...
