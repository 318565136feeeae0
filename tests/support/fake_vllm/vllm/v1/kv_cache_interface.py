from dataclasses import dataclass, field


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_size: int

    @property
    def page_size_bytes(self):
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_size


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list


@dataclass
class KVCacheGroupSpec:
    layer_names: list
    kv_cache_spec: FullAttentionSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list = field(default_factory=list)
    kv_cache_groups: list = field(default_factory=list)
