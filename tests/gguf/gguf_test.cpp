// GGUF files built byte by byte: every metadata type, the alignment, tensors in place; and every way a file can
// be malformed (each an invalid_argument naming the file and what is wrong, never a crash or a huge allocation).
// gguf_reference_test.py checks the dequantization of every type against gguf-py's, bit for bit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

using namespace rlloop;
namespace fs = std::filesystem;

namespace {

// A GGUF file under construction, little-endian as the format is.
struct Bytes {
  std::string b;
  template <class T>
  Bytes& put(T v) {
    b.append(reinterpret_cast<const char*>(&v), sizeof v);
    return *this;
  }
  Bytes& str(const std::string& s) {
    put<std::uint64_t>(s.size());
    b += s;
    return *this;
  }
  Bytes& pad_to(std::size_t alignment) {
    while (b.size() % alignment) b.push_back('\0');
    return *this;
  }
};

fs::path write(const std::string& name, const std::string& bytes) {
  const fs::path dir = fs::temp_directory_path() / ("rlloop-gguf-test-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path p = dir / name;
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// Header: magic, version, counts.
Bytes header(std::uint32_t version, std::uint64_t tensors, std::uint64_t kvs) {
  Bytes h;
  h.put<std::uint32_t>(0x46554747).put(version).put(tensors).put(kvs);
  return h;
}

// Value types' numbers in the file.
enum : std::uint32_t { U8 = 0, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 };

// A valid file: one key of each type, alignment 64, an F32 [2 rows x 4] tensor and a Q8_0 row of 32.
std::string valid_file() {
  Bytes f = header(3, 2, 16);
  f.str("a.u8").put(U8).put<std::uint8_t>(250);
  f.str("a.i8").put(I8).put<std::int8_t>(-5);
  f.str("a.u16").put(U16).put<std::uint16_t>(65000);
  f.str("a.i16").put(I16).put<std::int16_t>(-300);
  f.str("a.u32").put(U32).put<std::uint32_t>(4000000000u);
  f.str("a.i32").put(I32).put<std::int32_t>(-7);
  f.str("a.f32").put(F32).put<float>(0.5f);
  f.str("a.bool").put(BOOL).put<std::uint8_t>(1);
  f.str("a.str").put(STR).str("gpt2");
  f.str("a.u64").put(U64).put<std::uint64_t>(1ull << 40);
  f.str("a.i64").put(I64).put<std::int64_t>(-(1ll << 40));
  f.str("a.f64").put(F64).put<double>(0.1);
  f.str("a.strs").put(ARR).put(STR).put<std::uint64_t>(2).str("x").str("yz");
  f.str("a.nested").put(ARR).put(ARR).put<std::uint64_t>(1).put(I32).put<std::uint64_t>(2).put<std::int32_t>(4).put<std::int32_t>(5);
  f.str("general.alignment").put(U32).put<std::uint32_t>(64);
  f.str("general.architecture").put(STR).str("llama");
  // Tensor infos: name, dims, shape (fastest first), type, offset.
  f.str("w.f32").put<std::uint32_t>(2).put<std::uint64_t>(4).put<std::uint64_t>(2).put<std::uint32_t>(0).put<std::uint64_t>(0);
  f.str("w.q8").put<std::uint32_t>(1).put<std::uint64_t>(32).put<std::uint32_t>(8).put<std::uint64_t>(64);
  f.pad_to(64);
  for (int i = 0; i < 8; ++i) f.put<float>(static_cast<float>(i) - 2.5f);
  f.pad_to(64);
  f.put<std::uint16_t>(0x3800);  // d = 0.5
  for (int i = 0; i < 32; ++i) f.put<std::int8_t>(static_cast<std::int8_t>(i - 3));
  return f.b;
}

}  // namespace

TEST(Gguf, ReadsEveryMetadataTypeTheAlignmentAndTensorsInPlace) {
  const auto file = gguf::File::open(write("valid.gguf", valid_file()).string());
  EXPECT_EQ(file.version(), 3u);
  EXPECT_EQ(file.alignment(), 64u);
  EXPECT_EQ(file.metadata().size(), 16u);
  EXPECT_EQ(file.integer("a.u8"), 250);
  EXPECT_EQ(file.integer("a.i8"), -5);
  EXPECT_EQ(file.integer("a.u16"), 65000);
  EXPECT_EQ(file.integer("a.i16"), -300);
  EXPECT_EQ(file.integer("a.u32"), 4000000000ll);
  EXPECT_EQ(file.integer("a.i32"), -7);
  EXPECT_EQ(file.integer("a.u64"), 1ll << 40);
  EXPECT_EQ(file.integer("a.i64"), -(1ll << 40));
  EXPECT_EQ(file.number("a.f32"), 0.5);
  EXPECT_EQ(file.number("a.f64"), 0.1);
  EXPECT_EQ(file.number("a.i32"), -7.0);
  EXPECT_TRUE(file.boolean("a.bool"));
  EXPECT_EQ(file.string("a.str"), "gpt2");
  EXPECT_EQ(file.strings("a.strs"), (std::vector<std::string>{"x", "yz"}));
  const auto& nested = std::get<gguf::Array>(file.find("a.nested")->v);
  ASSERT_EQ(nested.size(), 1u);
  const auto& inner = std::get<gguf::Array>(nested[0].v);
  ASSERT_EQ(inner.size(), 2u);
  EXPECT_EQ(std::get<std::int32_t>(inner[1].v), 5);
  EXPECT_EQ(gguf::type_name(*file.find("a.u64")), "uint64");

  ASSERT_EQ(file.tensors().size(), 2u);
  const auto& w = file.tensor("w.f32");
  EXPECT_EQ(w.shape, (std::vector<std::int64_t>{4, 2}));
  EXPECT_EQ(w.elements(), 8);
  EXPECT_EQ(w.bytes(), 32u);
  EXPECT_EQ(file.dequantize(w), (std::vector<float>{-2.5f, -1.5f, -0.5f, 0.5f, 1.5f, 2.5f, 3.5f, 4.5f}));
  const auto& q = file.tensor("w.q8");
  EXPECT_EQ(q.type, gguf::TensorType::q8_0);
  EXPECT_EQ(q.bytes(), 34u);
  const auto values = file.dequantize(q);
  ASSERT_EQ(values.size(), 32u);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(values[i], 0.5f * static_cast<float>(i - 3)) << i;
}

TEST(Gguf, TypedReadsNameTheKeyAndBothTypes) {
  const auto path = write("typed.gguf", valid_file()).string();
  const auto file = gguf::File::open(path);
  EXPECT_EQ(error_of([&] { file.integer("a.str"); }), "GGUF file '" + path + "': metadata 'a.str' is string, not an integer");
  EXPECT_EQ(error_of([&] { file.string("a.u8"); }), "GGUF file '" + path + "': metadata 'a.u8' is uint8, not a string");
  EXPECT_EQ(error_of([&] { file.number("a.bool"); }), "GGUF file '" + path + "': metadata 'a.bool' is bool, not a number");
  EXPECT_EQ(error_of([&] { file.strings("a.nested"); }),
            "GGUF file '" + path + "': metadata 'a.nested' is array, not a string (in an array of strings)");
  EXPECT_EQ(error_of([&] { file.string("no.such"); }), "GGUF file '" + path + "' has no metadata 'no.such'");
  EXPECT_EQ(error_of([&] { file.tensor("w.none"); }), "GGUF file '" + path + "' has no tensor 'w.none'");
  EXPECT_THROW(file.string("no.such"), not_found);
  EXPECT_EQ(error_of([] { gguf::File::open("/nonexistent/x.gguf"); }), "GGUF file '/nonexistent/x.gguf' does not exist");
}

TEST(Gguf, AFileCutAnywhereIsAnErrorNotACrash) {
  const std::string whole = valid_file();
  for (std::size_t n = 0; n < whole.size(); ++n) {
    const auto path = write("cut.gguf", whole.substr(0, n)).string();
    const std::string error = error_of([&] { gguf::File::open(path); });
    EXPECT_NE(error.find(path), std::string::npos) << "cut at " << n << ": " << error;
    EXPECT_TRUE(error.find("truncated") != std::string::npos || error.find("ends past the file") != std::string::npos ||
                error.find("not a GGUF file") != std::string::npos || error.find("cannot fit") != std::string::npos ||
                error.find("does not fit") != std::string::npos || error.find("claims") != std::string::npos)
        << "cut at " << n << ": " << error;
  }
}

TEST(Gguf, MalformedFilesAreErrorsNamingWhatIsWrong) {
  struct Case {
    const char* name;
    std::string bytes;
    std::string expected;
  };
  auto tensor_file = [](std::uint32_t dims, std::vector<std::uint64_t> shape, std::uint32_t type, std::uint64_t offset) {
    Bytes f = header(3, 1, 0);
    f.str("t").put(dims);
    for (auto d : shape) f.put(d);
    f.put(type).put(offset).pad_to(32);
    f.b.append(4096, '\0');
    return f.b;
  };
  Bytes dup = header(3, 0, 2);
  dup.str("k").put(U8).put<std::uint8_t>(1).str("k").put(U8).put<std::uint8_t>(2);
  Bytes huge_array = header(3, 0, 1);
  huge_array.str("k").put(ARR).put(U64).put<std::uint64_t>(1ull << 60);
  Bytes huge_string = header(3, 0, 1);
  huge_string.str("k").put(STR).put<std::uint64_t>(1ull << 40);
  Bytes bad_bool = header(3, 0, 1);
  bad_bool.str("k").put(BOOL).put<std::uint8_t>(2);
  Bytes nul_key = header(3, 0, 1);  // a NUL in a key would end the message's what() before the fault
  nul_key.str(std::string("k\0x", 3)).put(BOOL).put<std::uint8_t>(2);
  Bytes bad_type = header(3, 0, 1);
  bad_type.str("k").put<std::uint32_t>(13).put<std::uint8_t>(0);
  Bytes bad_alignment = header(3, 0, 1);
  bad_alignment.str("general.alignment").put(U32).put<std::uint32_t>(48);
  Bytes deep = header(3, 0, 1);
  deep.str("k").put(ARR);  // an array of one array of one array ... (nine levels) of no uint8
  for (int i = 0; i < 9; ++i) deep.put(ARR).put<std::uint64_t>(1);
  deep.put(U8).put<std::uint64_t>(0);
  const std::string two_tensors = [] {
    Bytes f = header(3, 2, 0);
    for (int i = 0; i < 2; ++i) f.str("t").put<std::uint32_t>(1).put<std::uint64_t>(4).put<std::uint32_t>(0).put<std::uint64_t>(0);
    f.pad_to(32).b.append(64, '\0');
    return f.b;
  }();
  const Case cases[] = {
      {"magic", "GGML" + std::string(20, '\0'), "is not a GGUF file (it does not start with \"GGUF\")"},
      {"v1", header(1, 0, 0).b, "GGUF version 1; rlloop reads versions 2 and 3"},
      {"big-endian", header(0x03000000, 0, 0).b, "a big-endian GGUF file, which rlloop does not read"},
      {"duplicate key", dup.b, "metadata key 'k' appears twice"},
      {"huge array", huge_array.b, "metadata 'k': an array of 1152921504606846976 elements does not fit"},
      {"huge string", huge_string.b, "a string claims 1099511627776 bytes"},
      {"bool", bad_bool.b, "metadata 'k': a bool holds 2"},
      {"control bytes", nul_key.b, "metadata 'k\\x00x': a bool holds 2"},
      {"value type", bad_type.b, "metadata 'k': unknown value type 13"},
      {"alignment", bad_alignment.b, "general.alignment must be a uint32 power of two"},
      {"deep", deep.b, "metadata 'k': arrays nested deeper than 8"},
      {"5 dims", tensor_file(5, {1, 1, 1, 1, 1}, 0, 0), "tensor 't' has 5 dimensions (1 to 4 allowed)"},
      {"0 dim", tensor_file(2, {4, 0}, 0, 0), "tensor 't' has a dimension of 0"},
      {"q8_1", tensor_file(1, {32}, 9, 0), "tensor 't' is of ggml type 9, which rlloop does not read"},
      {"blocks", tensor_file(2, {16, 2}, 8, 0), "tensor 't': its rows of 16 are not whole Q8_0 blocks of 32"},
      {"misaligned", tensor_file(1, {4}, 0, 8), "tensor 't' starts at offset 8, not a multiple of the alignment 32"},
      {"too large", tensor_file(1, {4096}, 0, 0), "tensor 't' of 4096 F32 values is larger than the file"},
      {"past the end", tensor_file(1, {512}, 0, 2080), "tensor 't' (2048 bytes at data offset 2080) ends past the file's"},
      {"duplicate tensor", two_tensors, "tensor 't' appears twice"},
  };
  for (const auto& c : cases) {
    const auto path = write(std::string(c.name) + ".gguf", c.bytes).string();
    const std::string error = error_of([&] { gguf::File::open(path); });
    EXPECT_NE(error.find(c.expected), std::string::npos) << c.name << ": " << error;
    EXPECT_NE(error.find(path), std::string::npos) << c.name << ": " << error;
  }
}

TEST(Gguf, HalfAndBfloat16AsIeeeDefinesThem) {
  EXPECT_EQ(gguf::half_to_float(0x3C00), 1.0f);
  EXPECT_EQ(gguf::half_to_float(0xC000), -2.0f);
  EXPECT_EQ(gguf::half_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(gguf::half_to_float(0x0001), std::ldexp(1.0f, -24));  // the smallest subnormal
  EXPECT_EQ(gguf::half_to_float(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(gguf::half_to_float(0x0400), std::ldexp(1.0f, -14));  // the smallest normal
  EXPECT_TRUE(std::isinf(gguf::half_to_float(0x7C00)));
  EXPECT_TRUE(std::isnan(gguf::half_to_float(0x7E00)));
  EXPECT_TRUE(std::signbit(gguf::half_to_float(0x8000)));
  EXPECT_EQ(gguf::bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(gguf::bf16_to_float(0xC0A0), -5.0f);
}

TEST(Gguf, Q4_0AsTheBlockLayoutDefinesIt) {
  // d = 2 (f16 0x4000); byte j holds element j in its low nibble and element j + 16 in its high one; (q - 8) * d.
  std::vector<std::uint8_t> block{0x00, 0x40};
  for (int j = 0; j < 16; ++j) block.push_back(static_cast<std::uint8_t>(j | (15 - j) << 4));
  std::vector<float> out(32);
  gguf::dequantize(gguf::TensorType::q4_0, block, out);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[j], 2.0f * static_cast<float>(j - 8)) << j;
    EXPECT_EQ(out[j + 16], 2.0f * static_cast<float>(7 - j)) << j + 16;
  }
  std::vector<float> odd(31);
  EXPECT_EQ(error_of([&] { gguf::dequantize(gguf::TensorType::q4_0, block, odd); }),
            "gguf: 31 values of Q4_0 are not whole blocks of 32");
  std::vector<float> two(64);
  EXPECT_EQ(error_of([&] { gguf::dequantize(gguf::TensorType::q4_0, block, two); }),
            "gguf: 2 blocks of Q4_0 take 36 bytes, not 18");
  EXPECT_EQ(gguf::to_string(gguf::TensorType::q6_k), "Q6_K");
  EXPECT_EQ(gguf::to_string(static_cast<gguf::TensorType>(9)), "type 9");
}

namespace {

// What a refusal of a damaged file says is wrong: the first of these phrases its message holds (the reader's
// messages, src/gguf/file.cpp), "" for a message that names none of them.
std::string refusal_kind(const std::string& message) {
  static const char* const kinds[] = {
      "is not a GGUF file",   "big-endian",           "GGUF version",       "truncated",
      "claims",               "cannot fit",           "a bool holds",       "nested deeper",
      "unknown array element", "does not fit",        "unknown value type", "appears twice",
      "general.alignment",    "dimensions (1 to 4",   "a dimension of",     "which rlloop does not read",
      "are not whole",        "is larger than the file", "not a multiple of the alignment", "ends past the file",
  };
  for (const char* kind : kinds)
    if (message.find(kind) != std::string::npos) return kind;
  return "";
}

}  // namespace

TEST(Gguf, CorruptedBytesAreReadOrRefusedNeverACrash) {
  // 3,000 files, each the valid one with 1 to 4 random bytes overwritten: each opens and dequantizes (a value or a
  // count changed within bounds) or is refused with rlloop's error naming the file and what is wrong. How many of
  // each kind, for this seed, are golden values: a check the reader drops or a message it loses changes them (a
  // reader that stopped checking bools, say, opens the files it refused with "a bool holds"). scripts/sanitize.sh
  // runs this under ASan + UBSan, where an unchecked count or dimension shows as an overflow (UBSan) or a read past
  // a heap buffer (ASan). The file's own bytes are read through a read-only memory map, which ASan does not watch:
  // a read past them is held off by the reader's checks, which the golden counts pin.
  const std::string whole = valid_file();
  {  // the uncorrupted file opens; one with a bool of 2 is refused as such
    const auto file = gguf::File::open(write("intact.gguf", whole).string());
    EXPECT_EQ(file.dequantize(file.tensor("w.f32"))[7], 4.5f);
    std::string bad_bool = whole;
    const auto at = bad_bool.find("a.bool") + 6 + 4;  // the key, its value type: the value's byte
    ASSERT_EQ(bad_bool[at], 1);
    bad_bool[at] = 7;
    const auto path = write("bad-bool.gguf", bad_bool).string();
    const std::string expected = "GGUF file '" + path + "': metadata 'a.bool': a bool holds 7 (at byte ";
    EXPECT_EQ(error_of([&] { gguf::File::open(path); }).substr(0, expected.size()), expected);
  }
  std::mt19937 rng(11);
  std::map<std::string, int> counts;
  for (int i = 0; i < 3000; ++i) {
    std::string bytes = whole;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n; ++k) bytes[rng() % bytes.size()] = static_cast<char>(rng() % 256);
    const auto path = write("corrupt.gguf", bytes).string();
    try {
      const auto file = gguf::File::open(path);
      for (const auto& t : file.tensors()) file.dequantize(t);
      ++counts["opened"];
    } catch (const rlloop::error& e) {
      const std::string message = e.what();
      const std::string kind = refusal_kind(message);
      EXPECT_NE(kind, "") << "file " << i << ": a refusal that names no known fault: " << message;
      EXPECT_NE(message.find("'" + path + "'"), std::string::npos) << "file " << i << ": " << message;
      ++counts[kind];
    }
  }
  const std::map<std::string, int> golden = {
      {"opened", 627},
      {"GGUF version", 48},
      {"a bool holds", 7},
      {"a dimension of", 4},
      {"appears twice", 3},
      {"are not whole", 3},
      {"cannot fit", 119},
      {"claims", 1192},
      {"dimensions (1 to 4", 33},
      {"does not fit", 137},
      {"ends past the file", 49},
      {"general.alignment", 15},
      {"is larger than the file", 75},
      {"is not a GGUF file", 29},
      {"not a multiple of the alignment", 7},
      {"unknown array element", 67},
      {"unknown value type", 555},
      {"which rlloop does not read", 30},
  };
  std::string got;
  for (const auto& [kind, count] : counts) got += "      {\"" + kind + "\", " + std::to_string(count) + "},\n";
  EXPECT_EQ(counts, golden) << "counts for seed 11:\n" << got;
}

TEST(GgufWrite, FloatToHalfAndBfloat16RoundToNearestEven) {
  EXPECT_EQ(gguf::float_to_half(1.0f), 0x3C00);
  EXPECT_EQ(gguf::float_to_half(-2.0f), 0xC000);
  EXPECT_EQ(gguf::float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3C00);      // a tie: to the even 1.0
  EXPECT_EQ(gguf::float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // a tie: to the even 1 + 2^-9
  EXPECT_EQ(gguf::float_to_half(65504.0f), 0x7BFF);
  EXPECT_EQ(gguf::float_to_half(65519.0f), 0x7BFF);
  EXPECT_EQ(gguf::float_to_half(65520.0f), 0x7C00);  // the tie above the largest half goes to infinity
  EXPECT_EQ(gguf::float_to_half(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(gguf::float_to_half(std::ldexp(1.0f, -25)), 0x0000);      // a tie: to the even 0
  EXPECT_EQ(gguf::float_to_half(std::ldexp(3.0f, -25)), 0x0002);      // a tie: to the even 2 units
  EXPECT_EQ(gguf::float_to_half(std::ldexp(1023.5f, -24)), 0x0400);   // up into the smallest normal
  EXPECT_EQ(gguf::float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(gguf::float_to_half(INFINITY), 0x7C00);
  EXPECT_EQ(gguf::float_to_half(NAN) & 0x7E00, 0x7E00);
  EXPECT_EQ(gguf::float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(gguf::float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);      // a tie: to the even 1.0
  EXPECT_EQ(gguf::float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);  // a tie: to the even 1 + 2^-6
  EXPECT_TRUE(std::isnan(gguf::bf16_to_float(gguf::float_to_bf16(NAN))));
  for (std::uint32_t h = 0; h < 0x7C00; ++h)  // every finite half survives the round trip
    ASSERT_EQ(gguf::float_to_half(gguf::half_to_float(static_cast<std::uint16_t>(h))), h);
}

TEST(GgufWrite, Q8_0ScalesEachBlockByItsLargestValue) {
  std::vector<float> x(64);
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j - 16) / 4.0f;  // max |x| = 4: d = 4 / 127
  // The second block is all zero: scale 0, every value 0.
  const auto bytes = gguf::quantize(gguf::TensorType::q8_0, x);
  ASSERT_EQ(bytes.size(), 68u);
  EXPECT_EQ(bytes[0] | bytes[1] << 8, gguf::float_to_half(4.0f / 127.0f));
  EXPECT_EQ(static_cast<std::int8_t>(bytes[2]), -127);       // x = -4
  EXPECT_EQ(static_cast<std::int8_t>(bytes[2 + 16]), 0);     // x = 0
  EXPECT_EQ(static_cast<std::int8_t>(bytes[2 + 18]), 16);    // x = 0.5: 15.875 rounds to 16
  EXPECT_EQ(static_cast<std::int8_t>(bytes[2 + 31]), 119);   // x = 3.75: 119.06
  EXPECT_EQ(bytes[34] | bytes[35] << 8, 0);
  std::vector<float> back(64);
  gguf::dequantize(gguf::TensorType::q8_0, bytes, back);
  for (int j = 0; j < 64; ++j) EXPECT_NEAR(back[j], x[j], 2.0 / 127.0 + 1e-6) << j;
  EXPECT_EQ(error_of([&] { gguf::quantize(gguf::TensorType::q8_0, std::vector<float>(33)); }),
            "gguf: 33 values are not whole Q8_0 blocks of 32");
  EXPECT_EQ(error_of([&] { gguf::quantize(gguf::TensorType::q4_1, std::vector<float>(32)); }),
            "gguf: rlloop writes F32, F16, BF16, Q8_0, Q4_K and Q6_K tensors, not Q4_1");
}

TEST(GgufWrite, WhatIsWrittenReadsBackAsWritten) {
  // The byte-built file's metadata (every type, nested arrays, alignment 64) and tensors, written again.
  const auto source = gguf::File::open(write("source.gguf", valid_file()).string());
  std::vector<gguf::TensorData> tensors;
  for (const auto& t : source.tensors()) {
    const auto bytes = source.bytes(t);
    tensors.push_back({t.name, t.shape, t.type, {bytes.begin(), bytes.end()}});
  }
  const std::vector<float> values{1.0f, -0.5f, 3.0f, 1e-3f, 0.0f, 2.0f};
  tensors.push_back({"w.half", {3, 2}, gguf::TensorType::f16, gguf::quantize(gguf::TensorType::f16, values)});
  const fs::path out = fs::path(source.path()).parent_path() / "written.gguf";
  gguf::write(out.string(), source.metadata(), tensors, 64);

  const auto back = gguf::File::open(out.string());
  EXPECT_EQ(back.version(), 3u);
  EXPECT_EQ(back.alignment(), 64u);
  ASSERT_EQ(back.metadata().size(), source.metadata().size());
  for (const auto& [key, value] : source.metadata()) {
    const auto* got = back.find(key);
    ASSERT_NE(got, nullptr) << key;
    EXPECT_EQ(got->v, value.v) << key;
  }
  ASSERT_EQ(back.tensors().size(), 3u);
  for (const auto& t : source.tensors()) {
    const auto& b = back.tensor(t.name);
    EXPECT_EQ(b.shape, t.shape);
    EXPECT_EQ(b.type, t.type);
    EXPECT_EQ(b.offset % 64, 0u);
    EXPECT_EQ(back.dequantize(b), source.dequantize(t)) << t.name;
  }
  const auto half = back.dequantize(back.tensor("w.half"));
  for (std::size_t i = 0; i < values.size(); ++i) EXPECT_NEAR(half[i], values[i], 1e-6) << i;

  // The default alignment leaves general.alignment out.
  gguf::write(out.string(), {{"general.architecture", {std::string("llama")}}}, tensors);
  const auto plain = gguf::File::open(out.string());
  EXPECT_EQ(plain.alignment(), 32u);
  EXPECT_EQ(plain.find("general.alignment"), nullptr);
  EXPECT_EQ(plain.metadata().size(), 1u);
}

TEST(GgufWrite, BadInputIsAnErrorAndLeavesTheFileAsItWas) {
  const fs::path dir = fs::path(write("keep.gguf", valid_file())).parent_path();
  const std::string keep = (dir / "keep.gguf").string();
  const gguf::TensorData f32{"w", {4}, gguf::TensorType::f32, std::vector<std::uint8_t>(16)};
  struct Case {
    std::string name;
    std::map<std::string, gguf::Value> metadata;
    std::vector<gguf::TensorData> tensors;
    std::uint32_t alignment;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"duplicate", {}, {f32, f32}, 32, "gguf: tensor 'w' appears twice"},
      {"short bytes", {}, {{"w", {8}, gguf::TensorType::f32, std::vector<std::uint8_t>(16)}}, 32,
       "gguf: tensor 'w' of 8 F32 values takes 32 bytes, not 16"},
      {"partial block", {}, {{"w", {16}, gguf::TensorType::q8_0, std::vector<std::uint8_t>(34)}}, 32,
       "gguf: tensor 'w': rows of 16 are not whole Q8_0 blocks of 32"},
      {"no dims", {}, {{"w", {}, gguf::TensorType::f32, {}}}, 32, "gguf: tensor 'w' has 0 dimensions (1 to 4 allowed)"},
      {"mixed array", {{"a", {gguf::Array{{std::int32_t{1}}, {std::string("x")}}}}}, {}, 32,
       "gguf: metadata 'a' mixes int32 and string in one array"},
      {"alignment", {}, {f32}, 48, "gguf: the alignment must be a power of two, not 48"},
  };
  const auto before = gguf::File::open(keep).metadata().size();
  for (const auto& c : cases) {
    EXPECT_EQ(error_of([&] { gguf::write(keep, c.metadata, c.tensors, c.alignment); }), c.expected) << c.name;
    EXPECT_EQ(gguf::File::open(keep).metadata().size(), before) << c.name;
  }
  const std::string nowhere = (dir / "no-such-dir" / "x.gguf").string();
  const std::string error = error_of([&] { gguf::write(nowhere, {}, {f32}); });
  EXPECT_NE(error.find("cannot write GGUF file '" + nowhere + "'"), std::string::npos) << error;
  for (const auto& entry : fs::directory_iterator(dir))  // no temporary file left behind
    EXPECT_EQ(entry.path().extension(), ".gguf") << entry.path();
}
