"""DeepReduce: a sparse-tensor communication framework (Kostopoulou, Xu, Dutta, Li, Ntoulas,
Kalnis, *DeepReduce: A Sparse-tensor Communication Framework for Distributed Deep
Learning*; and C. P. Kostopoulou, *Sparse Communication for Deep Learning*, MSc thesis 2020).

`DeepReduce` wraps any sparsifier and encodes its indices and values with independent
codecs from the ``index_codec`` and ``value_codec`` registries:

    index: raw32, packed, bitmap, rle, huffman, delta_varint, deflate, bloom
    value: raw, fp16, deflate, qsgd, polyfit, dexp
"""

from gracecomm.compressors.deepreduce.bloom import BloomIndex, bloom_size, expected_fpr
from gracecomm.compressors.deepreduce.codec import (
                                          INDEX_CODECS,
                                          VALUE_CODECS,
                                          CodecCtx,
                                          IndexCodec,
                                          ValueCodec,
)
from gracecomm.compressors.deepreduce.compressor import DeepReduce, NonZero
from gracecomm.compressors.deepreduce.fitting import DExpValues, PolyFitValues
from gracecomm.compressors.deepreduce.index import (
                                          BitmapIndex,
                                          DeflateIndex,
                                          DeltaVarintIndex,
                                          HuffmanIndex,
                                          PackedIndex,
                                          Raw32Index,
                                          RLEIndex,
)
from gracecomm.compressors.deepreduce.values import (
                                          CompressorValues,
                                          DeflateValues,
                                          FP16Values,
                                          QSGDValues,
                                          RawValues,
)

__all__ = [
    "INDEX_CODECS", "VALUE_CODECS", "BitmapIndex", "BloomIndex", "CodecCtx", "DExpValues",
    "CompressorValues", "DeepReduce", "DeflateIndex", "DeflateValues", "DeltaVarintIndex",
    "FP16Values", "HuffmanIndex", "IndexCodec", "NonZero", "PackedIndex", "PolyFitValues",
    "QSGDValues", "RLEIndex", "Raw32Index", "RawValues", "ValueCodec", "bloom_size",
    "expected_fpr",
]
