// Writers of the token files other tools produce, byte by byte from their documented layouts, for
// the reader tests: a Megatron-Core indexed dataset (PREFIX.bin + PREFIX.idx, as _IndexWriter
// writes it) and an llm.c token shard (dev/data/data_common.py write_datafile). Little-endian.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace moe::testing {

using Bytes = std::vector<uint8_t>;

inline void put_le(Bytes& b, uint64_t v, int width) {
  for (int i = 0; i < width; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

inline Bytes le_array(const std::vector<uint64_t>& values, int width) {
  Bytes b;
  for (uint64_t v : values) put_le(b, v, width);
  return b;
}

inline void write_bytes(const std::string& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Megatron dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.
inline int megatron_dtype_width(int code) {
  switch (code) {
    case 1: case 2: return 1;
    case 3: case 8: return 2;
    case 4: case 7: return 4;
    default: return 8;
  }
}

// The .idx of `docs`, each document a list of sequences of token ids: magic "MMIDIDX\0\0", uint64
// version, uint8 dtype code, uint64 sequence count N, uint64 document count (documents + 1), int32
// lengths[N], int64 byte pointers[N] (sequences end to end in the .bin), int64 document indices
// (0, then the sequence count after each document).
inline Bytes megatron_idx(const std::vector<std::vector<std::vector<uint64_t>>>& docs, int dtype_code,
                          uint64_t version = 1) {
  std::vector<uint64_t> lengths, pointers, doc_indices = {0};
  uint64_t ptr = 0;
  for (const auto& doc : docs) {
    for (const auto& seq : doc) {
      lengths.push_back(seq.size());
      pointers.push_back(ptr);
      ptr += seq.size() * megatron_dtype_width(dtype_code);
    }
    doc_indices.push_back(lengths.size());
  }
  Bytes b = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
  put_le(b, version, 8);
  put_le(b, static_cast<uint64_t>(dtype_code), 1);
  put_le(b, lengths.size(), 8);
  put_le(b, doc_indices.size(), 8);
  for (uint64_t v : lengths) put_le(b, v, 4);
  for (uint64_t v : pointers) put_le(b, v, 8);
  for (uint64_t v : doc_indices) put_le(b, v, 8);
  return b;
}

// The .bin of `docs`: every sequence's ids in order, little-endian in the dtype's width.
inline Bytes megatron_bin(const std::vector<std::vector<std::vector<uint64_t>>>& docs, int dtype_code) {
  Bytes b;
  for (const auto& doc : docs)
    for (const auto& seq : doc) {
      const Bytes s = le_array(seq, megatron_dtype_width(dtype_code));
      b.insert(b.end(), s.begin(), s.end());
    }
  return b;
}

// Writes PREFIX.bin and PREFIX.idx; returns the prefix.
inline std::string write_megatron(const std::string& prefix, const std::vector<std::vector<std::vector<uint64_t>>>& docs,
                                  int dtype_code) {
  write_bytes(prefix + ".bin", megatron_bin(docs, dtype_code));
  write_bytes(prefix + ".idx", megatron_idx(docs, dtype_code));
  return prefix;
}

// An llm.c file: 256 int32 header words (magic, version, count, zeros), then `payload`.
inline Bytes llmc_file(int32_t magic, int32_t version, int32_t count, const Bytes& payload) {
  Bytes b;
  put_le(b, static_cast<uint32_t>(magic), 4);
  put_le(b, static_cast<uint32_t>(version), 4);
  put_le(b, static_cast<uint32_t>(count), 4);
  b.resize(1024, 0);
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

// An llm.c token shard of `ids`: GPT-2 (magic 20240520, version 1, uint16) or Llama 3 (magic
// 20240801, version 7, uint32).
inline Bytes llmc_shard(const std::vector<uint64_t>& ids, bool uint32_tokens) {
  return uint32_tokens ? llmc_file(20240801, 7, static_cast<int32_t>(ids.size()), le_array(ids, 4))
                       : llmc_file(20240520, 1, static_cast<int32_t>(ids.size()), le_array(ids, 2));
}

}  // namespace moe::testing
