// Config parsing, overrides, validation and serialisation (core/config_io.h): every key type
// through both input paths, suggestions for unknown keys, one failing case per validation rule
// (the message must name the key), exact round trips and configs/tiny.toml == the defaults.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>

#include "support/test_util.h"
#include "core/config_io.h"
#include "core/error.h"

namespace moe::testing {
namespace {

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "missing: " << (part) << "\nin: " << (text)

Config with(std::initializer_list<std::string> overrides) {
  Config c;
  for (const auto& o : overrides) apply_override(c, o);
  return c;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// ---------------------------------------------------------------- registry and defaults

TEST(ConfigKeys, EveryKeyHasItsOwnFieldAndDescription) {
  Config c;
  std::set<const void*> fields;
  std::set<std::string> names;
  for (const auto& k : config_keys()) {
    const void* addr = std::visit([](auto* p) { return static_cast<const void*>(p); }, k.field(c));
    EXPECT_TRUE(fields.insert(addr).second) << k.name << " shares a field with another key";
    EXPECT_TRUE(names.insert(k.name).second) << k.name << " listed twice";
    EXPECT_FALSE(k.description.empty()) << k.name;
    EXPECT_EQ(find_config_key(k.name), &k);
  }
  // 11 model + 11 moe + 10 train + 12 optim + 7 data + 11 parallel + 5 checkpoint + 1 run + 3 log.
  EXPECT_EQ(config_keys().size(), 72u);
  EXPECT_EQ(find_config_key("moe.topk"), nullptr);
  EXPECT_EQ(find_config_key("model.dense_layers")->type, ConfigType::kIntList);
  EXPECT_EQ(find_config_key("train.seed")->type, ConfigType::kUint);
  EXPECT_STREQ(config_type_name(ConfigType::kStringList), "string list");
}

TEST(ConfigValidate, DefaultsAreValid) { EXPECT_NO_THROW(validate_config(Config{})); }

TEST(ConfigLoad, EmptyPathGivesDefaults) {
  EXPECT_EQ(config_to_toml(load_config("", {})), config_to_toml(Config{}));
}

TEST(ConfigLoad, TinyTomlEqualsDefaults) {
  const std::string path = std::string(MOECORE_SOURCE_DIR) + "/configs/tiny.toml";
  const Config parsed = parse_config_toml(read_file(path), path);
  EXPECT_EQ(config_to_toml(parsed), config_to_toml(Config{}));
  EXPECT_EQ(config_to_toml(load_config(path, {})), config_to_toml(Config{}));
}

TEST(ConfigLoad, FileThenOverridesInOrderThenValidation) {
  const std::string path = std::string(MOECORE_SOURCE_DIR) + "/configs/tiny.toml";
  const Config c = load_config(path, {"--train.steps=7", "--train.steps=9", "optim.lr=1e-2"});
  EXPECT_EQ(c.train.steps, 9);
  EXPECT_EQ(c.optim.lr, 1e-2);
  EXPECT_CONTAINS(error_of([&] { load_config(path, {"--moe.top_k=9"}); }), "moe.top_k");
}

// Data paths in a config file are relative to the file; those of overrides and absolute ones stay.
TEST(ConfigLoad, DataPathsRelativeToTheConfigFile) {
  const TempDir tmp("cfg_paths");
  const std::filesystem::path dir = tmp.root() / "configs";
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir / "run.toml");
    f << "[data]\nsource = \"tokens\"\npaths = [\"../data/a.bin\", \"/abs/b.bin\"]\neval_paths = [\"e.bin\"]\n";
  }
  const Config c = load_config((dir / "run.toml").string(), {});
  ASSERT_EQ(c.data.paths.size(), 2u);
  EXPECT_EQ(c.data.paths[0], (tmp.root() / "data" / "a.bin").lexically_normal().string());
  EXPECT_EQ(c.data.paths[1], "/abs/b.bin");
  EXPECT_EQ(c.data.eval_paths.at(0), (dir / "e.bin").lexically_normal().string());
  const Config o = load_config((dir / "run.toml").string(), {"--data.paths=x.bin"});
  EXPECT_EQ(o.data.paths.at(0), "x.bin");  // typed on the command line: the working directory's
}

TEST(ConfigLoad, MissingFileNamesThePath) {
  const std::string msg = error_of([] { load_config("/nonexistent/dir/run.toml", {}); });
  EXPECT_CONTAINS(msg, "/nonexistent/dir/run.toml");
}

// ---------------------------------------------------------------- overrides

TEST(ConfigOverride, Int) {
  EXPECT_EQ(with({"--train.steps=10"}).train.steps, 10);
  EXPECT_EQ(with({"train.steps=+12"}).train.steps, 12);
  EXPECT_EQ(with({"--parallel.dp=-3"}).parallel.dp, -3);  // parsed; validation rejects it later
  EXPECT_EQ(with({"--train.seed=9223372036854775807"}).train.seed, 9223372036854775807ull);
  EXPECT_CONTAINS(error_of([] { with({"--train.steps=ten"}); }),
                  "train.steps: expected an integer, got \"ten\"");
  EXPECT_CONTAINS(error_of([] { with({"--train.steps=1.5"}); }), "train.steps");
  EXPECT_CONTAINS(error_of([] { with({"--train.seed=-1"}); }), "train.seed: expected a non-negative integer");
}

TEST(ConfigOverride, FloatWithExponentAndInteger) {
  EXPECT_EQ(with({"--optim.lr=1e-3"}).optim.lr, 1e-3);
  EXPECT_EQ(with({"--optim.eps=2.5E-10"}).optim.eps, 2.5e-10);
  EXPECT_EQ(with({"--model.rope_theta=500000"}).model.rope_theta, 500000.0);
  EXPECT_EQ(with({"--optim.beta2=.99"}).optim.beta2, 0.99);
  EXPECT_CONTAINS(error_of([] { with({"--optim.lr=fast"}); }), "optim.lr: expected a number");
}

TEST(ConfigOverride, Bool) {
  EXPECT_FALSE(with({"--model.qk_norm=false"}).model.qk_norm);
  EXPECT_TRUE(with({"--moe.norm_topk_prob=true"}).moe.norm_topk_prob);
  EXPECT_CONTAINS(error_of([] { with({"--model.qk_norm=yes"}); }), "model.qk_norm: expected a boolean");
}

TEST(ConfigOverride, StringAndEnum) {
  EXPECT_EQ(with({"--run.dir=/tmp/run 1"}).run.dir, "/tmp/run 1");
  EXPECT_EQ(with({"--run.dir=\"a\\tb\""}).run.dir, "a\tb");
  EXPECT_EQ(with({"--checkpoint.dir='c:\\x'"}).checkpoint.dir, "c:\\x");
  EXPECT_EQ(with({"--checkpoint.dir="}).checkpoint.dir, "");
  EXPECT_EQ(with({"--moe.router=sigmoid"}).moe.router, "sigmoid");
  EXPECT_EQ(with({"--train.precision=bf16"}).train.precision, "bf16");
  const std::string msg = error_of([] { with({"--moe.router=softmx"}); });
  EXPECT_CONTAINS(msg, "moe.router: expected one of \"softmax\", \"sigmoid\", got \"softmx\"");
  EXPECT_CONTAINS(msg, "did you mean \"softmax\"?");
  EXPECT_CONTAINS(error_of([] { with({"--train.device=tpu"}); }), "train.device");
  EXPECT_CONTAINS(error_of([] { with({"--optim.schedule=step"}); }), "optim.schedule");
  EXPECT_CONTAINS(error_of([] { with({"--data.token_dtype=int8"}); }), "data.token_dtype");
  EXPECT_CONTAINS(error_of([] { with({"--parallel.ep_backend=deepep"}); }), "parallel.ep_backend");
  EXPECT_EQ(Config{}.parallel.grad_reduce_dtype, "fp32");
  EXPECT_EQ(with({"--parallel.grad_reduce_dtype=bf16"}).parallel.grad_reduce_dtype, "bf16");
  EXPECT_CONTAINS(error_of([] { with({"--parallel.grad_reduce_dtype=fp16"}); }),
                  "parallel.grad_reduce_dtype: expected one of \"fp32\", \"bf16\", got \"fp16\"");
  EXPECT_CONTAINS(error_of([] { with({"--train.recompute=some"}); }), "train.recompute");
  EXPECT_CONTAINS(error_of([] { with({"--moe.routing=greedy"}); }), "moe.routing");
  EXPECT_CONTAINS(error_of([] { with({"--data.source=web"}); }), "data.source");
}

TEST(ConfigOverride, ListsInBothForms) {
  const std::vector<int64_t> want = {0, 1};
  EXPECT_EQ(with({"--model.dense_layers=[0, 1]"}).model.dense_layers, want);
  EXPECT_EQ(with({"--model.dense_layers=0,1"}).model.dense_layers, want);
  EXPECT_EQ(with({"--model.dense_layers= 0 , 1 "}).model.dense_layers, want);
  EXPECT_EQ(with({"--model.dense_layers=3"}).model.dense_layers, std::vector<int64_t>{3});
  EXPECT_TRUE(with({"--model.dense_layers="}).model.dense_layers.empty());
  EXPECT_TRUE(with({"--model.dense_layers=[]"}).model.dense_layers.empty());
  const std::vector<std::string> paths = {"a.bin", "b.bin"};
  EXPECT_EQ(with({"--data.paths=a.bin,b.bin"}).data.paths, paths);
  EXPECT_EQ(with({"--data.paths=[\"a.bin\", \"b.bin\"]"}).data.paths, paths);
  EXPECT_EQ(with({"--data.eval_paths=['x,y']"}).data.eval_paths, std::vector<std::string>{"x,y"});
  EXPECT_EQ(with({"--data.eval_paths=\"a\", 'b'"}).data.eval_paths, std::vector<std::string>({"a", "b"}));
  EXPECT_CONTAINS(error_of([] { with({"--model.dense_layers=0,x"}); }), "model.dense_layers");
  EXPECT_CONTAINS(error_of([] { with({"--model.dense_layers=0,,1"}); }), "model.dense_layers");
  EXPECT_CONTAINS(error_of([] { with({"--model.dense_layers=[0, \"a\"]"}); }), "element 1 is the string \"a\"");
  EXPECT_CONTAINS(error_of([] { with({"--model.dense_layers=[0,"}); }), "model.dense_layers");
  EXPECT_CONTAINS(error_of([] { with({"--data.paths=[1, 2]"}); }), "data.paths: expected an array of strings");
}

TEST(ConfigOverride, UnknownKeyAndMalformedArgument) {
  std::string msg = error_of([] { with({"--moe.topk=4"}); });
  EXPECT_CONTAINS(msg, "unknown key 'moe.topk'");
  EXPECT_CONTAINS(msg, "--moe.topk=4");
  EXPECT_CONTAINS(msg, "did you mean 'moe.top_k'?");
  EXPECT_CONTAINS(error_of([] { with({"--train.steps"}); }), "must look like --section.key=value");
  EXPECT_CONTAINS(error_of([] { with({"--=3"}); }), "must look like --section.key=value");
}

// ---------------------------------------------------------------- TOML parsing

TEST(ConfigParse, PartialFileKeepsDefaults) {
  const Config c = parse_config_toml("[moe]\nnum_experts = 64\ntop_k = 8\n[optim]\nlr = 1\n", "p.toml");
  EXPECT_EQ(c.moe.num_experts, 64);
  EXPECT_EQ(c.moe.top_k, 8);
  EXPECT_EQ(c.optim.lr, 1.0);  // an integer where a float is expected
  Config want;
  want.moe.num_experts = 64;
  want.moe.top_k = 8;
  want.optim.lr = 1.0;
  EXPECT_EQ(config_to_toml(c), config_to_toml(want));
  EXPECT_EQ(parse_config_toml("train.steps = 5\n", "dotted.toml").train.steps, 5);  // dotted key at the root
}

TEST(ConfigParse, UnknownKeySuggestions) {
  std::string msg = error_of([] { parse_config_toml("[moe]\ntopk = 4\n", "run.toml"); });
  EXPECT_CONTAINS(msg, "unknown key 'moe.topk' in run.toml:2; did you mean 'moe.top_k'?");
  msg = error_of([] { parse_config_toml("[mdoel]\nd_model = 64\n", "run.toml"); });  // section typo
  EXPECT_CONTAINS(msg, "unknown key 'mdoel.d_model'");
  EXPECT_CONTAINS(msg, "did you mean 'model.d_model'?");
  msg = error_of([] { parse_config_toml("[trian]\n", "run.toml"); });
  EXPECT_CONTAINS(msg, "unknown section [trian] in run.toml:1; did you mean [train]?");
  msg = error_of([] { parse_config_toml("steps = 5\n", "run.toml"); });  // key outside its section
  EXPECT_CONTAINS(msg, "did you mean 'train.steps'?");
  msg = error_of([] { parse_config_toml("[model]\ntop_k = 2\n", "run.toml"); });  // key in the wrong section
  EXPECT_CONTAINS(msg, "did you mean 'moe.top_k'?");
  msg = error_of([] { parse_config_toml("[model.extra]\nx = 1\n", "run.toml"); });
  EXPECT_CONTAINS(msg, "unknown key 'model.extra'");
}

TEST(ConfigParse, NearestKey) {
  EXPECT_EQ(nearest_key("moe.topk"), "moe.top_k");
  EXPECT_EQ(nearest_key("trian.steps"), "train.steps");
  EXPECT_EQ(nearest_key("model.dmodel"), "model.d_model");
  EXPECT_EQ(nearest_key("Optim.LR"), "optim.lr");
  EXPECT_EQ(nearest_key("optim.warmup"), "optim.warmup_steps");
  EXPECT_EQ(nearest_key("moe.experts"), "moe.num_experts");
  EXPECT_EQ(nearest_key("train.lr"), "optim.lr");
  EXPECT_EQ(nearest_key("completely.unrelated_thing"), "");
  EXPECT_EQ(nearest_key("foo.bar"), "");
}

TEST(ConfigParse, TypeErrorsNameKeyTypeValueAndLine) {
  std::string msg = error_of([] { parse_config_toml("[train]\nsteps = \"ten\"\n", "run.toml"); });
  EXPECT_CONTAINS(msg, "train.steps: expected an integer, got the string \"ten\"");
  EXPECT_CONTAINS(msg, "run.toml:2");
  EXPECT_CONTAINS(error_of([] { parse_config_toml("[train]\nsteps = 1.5\n", "r.toml"); }),
                  "train.steps: expected an integer, got the float 1.5");
  EXPECT_CONTAINS(error_of([] { parse_config_toml("[model]\nqk_norm = 1\n", "r.toml"); }),
                  "model.qk_norm: expected a boolean (true or false), got the integer 1");
  EXPECT_CONTAINS(error_of([] { parse_config_toml("[optim]\nlr = \"fast\"\n", "r.toml"); }),
                  "optim.lr: expected a number, got the string \"fast\"");
  EXPECT_CONTAINS(error_of([] { parse_config_toml("[run]\ndir = 3\n", "r.toml"); }),
                  "run.dir: expected a string, got the integer 3");
  EXPECT_CONTAINS(error_of([] { parse_config_toml("[model]\ndense_layers = 0\n", "r.toml"); }),
                  "model.dense_layers: expected an array of integers, got the integer 0");
  EXPECT_CONTAINS(error_of([] { parse_config_toml("[data]\npaths = [\"a\", 2]\n", "r.toml"); }),
                  "data.paths: expected an array of strings, element 1 is the integer 2");
  EXPECT_CONTAINS(error_of([] { parse_config_toml("[train]\nseed = -5\n", "r.toml"); }),
                  "train.seed: expected a non-negative integer, got the integer -5");
  EXPECT_CONTAINS(error_of([] { parse_config_toml("[moe]\nrouter = \"relu\"\n", "r.toml"); }), "moe.router");
  EXPECT_CONTAINS(error_of([] { parse_config_toml("model = 3\n", "r.toml"); }), "'model' must be a table");
}

TEST(ConfigParse, AllProblemsReportedInLineOrder) {
  const std::string msg = error_of([] {
    parse_config_toml("[train]\nsteps = \"x\"\n[moe]\ntopk = 1\n[model]\nd_model = true\n", "r.toml");
  });
  const size_t a = msg.find("train.steps"), b = msg.find("moe.topk"), c = msg.find("model.d_model");
  ASSERT_NE(a, std::string::npos);
  ASSERT_NE(b, std::string::npos);
  ASSERT_NE(c, std::string::npos);
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
}

TEST(ConfigParse, SyntaxErrorNamesFileAndLine) {
  const std::string msg = error_of([] { parse_config_toml("[train]\nsteps = = 3\n", "broken.toml"); });
  EXPECT_CONTAINS(msg, "invalid TOML in broken.toml:2");
}

// ---------------------------------------------------------------- validation rules

struct RuleCase {
  std::string name;
  std::function<void(Config&)> mutate;
  std::vector<std::string> expect;  // substrings of the message; the first is the key
};

RuleCase over(std::string name, std::vector<std::string> overrides, std::vector<std::string> expect) {
  return {std::move(name),
          [overrides](Config& c) {
            for (const auto& o : overrides) apply_override(c, o);
          },
          std::move(expect)};
}

// Sets a string key through the table, bypassing the enum check of apply_override.
RuleCase raw(std::string name, const std::string& key, std::string value, std::vector<std::string> expect) {
  return {std::move(name),
          [key, value](Config& c) { *std::get<std::string*>(find_config_key(key)->field(c)) = value; },
          std::move(expect)};
}

class ConfigRule : public ::testing::TestWithParam<RuleCase> {};

TEST_P(ConfigRule, FailsNamingTheKey) {
  Config c;
  GetParam().mutate(c);
  const std::string msg = error_of([&] { validate_config(c); });
  EXPECT_CONTAINS(msg, "invalid configuration");
  for (const auto& part : GetParam().expect) EXPECT_CONTAINS(msg, part);
}

const uint64_t kBigSeed = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) + 1;

INSTANTIATE_TEST_SUITE_P(
    ConfigRules, ConfigRule,
    ::testing::Values(
        over("vocab_size", {"model.vocab_size=0"}, {"model.vocab_size must be > 0, got 0"}),
        over("fp8_scaling", {"train.fp8_scaling=mx"},
             {"train.fp8_scaling = \"mx\" scales FP8 operands", "train.precision = \"fp8\", got \"fp32\""}),
        over("d_model", {"model.d_model=-8"}, {"model.d_model must be > 0, got -8"}),
        over("n_layers", {"model.n_layers=0", "model.dense_layers="}, {"model.n_layers must be > 0"}),
        over("n_heads", {"model.n_heads=0"}, {"model.n_heads must be > 0"}),
        over("n_kv_heads", {"model.n_kv_heads=0"}, {"model.n_kv_heads must be > 0"}),
        over("d_model_div", {"model.d_model=130"},
             {"model.d_model (130) must be divisible by model.n_heads (4): 130 % 4 = 2"}),
        over("head_dim_even", {"model.d_model=132"},
             {"head_dim = model.d_model / model.n_heads = 132 / 4 = 33 must be even for RoPE"}),
        over("kv_div", {"model.n_kv_heads=3"},
             {"model.n_heads (4) must be divisible by model.n_kv_heads (3): 4 % 3 = 1"}),
        over("rope_theta", {"model.rope_theta=0"}, {"model.rope_theta must be > 0"}),
        over("norm_eps", {"model.norm_eps=-1e-5"}, {"model.norm_eps must be > 0"}),
        over("init_std", {"model.init_std=0"}, {"model.init_std must be > 0"}),
        over("dense_range_hi", {"model.dense_layers=0,4"},
             {"model.dense_layers[1] = 4 is not a layer index in [0, model.n_layers = 4)"}),
        over("dense_range_lo", {"model.dense_layers=-1"}, {"model.dense_layers[0] = -1"}),
        over("dense_dup", {"model.dense_layers=1,2,1"}, {"model.dense_layers lists layer 1 more than once"}),
        over("dense_hidden", {"model.dense_hidden=0"},
             {"model.dense_hidden must be > 0 when model.dense_layers"}),
        over("num_experts", {"moe.num_experts=0"}, {"moe.num_experts must be > 0"}),
        over("top_k_pos", {"moe.top_k=0"}, {"moe.top_k must be > 0"}),
        over("top_k_le_e", {"moe.top_k=9"}, {"moe.top_k (9) must be <= moe.num_experts (8)"}),
        over("expert_hidden", {"moe.expert_hidden=0"}, {"moe.expert_hidden must be > 0"}),
        over("shared_experts", {"moe.shared_experts=-1"}, {"moe.shared_experts must be >= 0"}),
        over("lb_weight", {"moe.lb_loss_weight=-0.1"}, {"moe.lb_loss_weight must be >= 0"}),
        over("z_weight", {"moe.z_loss_weight=-1e-3"}, {"moe.z_loss_weight must be >= 0"}),
        over("bias_rate", {"moe.bias_update_rate=-1"}, {"moe.bias_update_rate must be >= 0"}),
        over("capacity", {"moe.capacity_factor=0.5"},
             {"moe.capacity_factor must be 0 (dropless) or >= 1, got 0.5"}),
        raw("router_enum", "moe.router", "relu", {"moe.router", "\"relu\""}),
        raw("routing_enum", "moe.routing", "x", {"moe.routing"}),
        over("seq_len", {"train.seq_len=0"}, {"train.seq_len must be > 0"}),
        over("micro_batch", {"train.micro_batch=0"}, {"train.micro_batch must be > 0"}),
        over("global_batch", {"train.global_batch=-16"}, {"train.global_batch must be > 0"}),
        over("global_div", {"train.global_batch=20"},
             {"train.global_batch (20) must be a multiple of train.micro_batch (8): 20 % 8 = 4"}),
        over("steps", {"train.steps=-1"}, {"train.steps must be >= 0"}),
        RuleCase{
            "seed", [](Config& c) { c.train.seed = kBigSeed; }, {"train.seed must be <= 9223372036854775807"}},
        raw("precision_enum", "train.precision", "fp16", {"train.precision"}),
        raw("recompute_enum", "train.recompute", "all", {"train.recompute"}),
        raw("device_enum", "train.device", "gpu", {"train.device"}),
        over("eval_interval", {"train.eval_interval=-1"}, {"train.eval_interval must be >= 0"}),
        over("eval_batches", {"train.eval_batches=-1"}, {"train.eval_batches must be >= 0"}),
        over("eval_batches_needed", {"train.eval_batches=0"}, {"train.eval_batches must be >= 1 when"}),
        over("lr_ge_min_lr", {"optim.min_lr=0.01"}, {"optim.lr (0.003) must be >= optim.min_lr (0.01)"}),
        over("min_lr", {"optim.min_lr=-1e-4"}, {"optim.min_lr must be >= 0"}),
        over("lr_finite", {"optim.lr=nan"}, {"optim.lr must be finite, got nan"}),
        over("warmup", {"optim.warmup_steps=-5"}, {"optim.warmup_steps must be >= 0"}),
        raw("schedule_enum", "optim.schedule", "step", {"optim.schedule"}),
        over("beta1_hi", {"optim.beta1=1"}, {"optim.beta1 must be in [0, 1), got 1.0"}),
        over("beta2_lo", {"optim.beta2=-0.5"}, {"optim.beta2 must be in [0, 1)"}),
        over("eps", {"optim.eps=0"}, {"optim.eps must be > 0"}),
        over("weight_decay", {"optim.weight_decay=-0.1"}, {"optim.weight_decay must be >= 0"}),
        over("grad_clip", {"optim.grad_clip=-1"}, {"optim.grad_clip must be >= 0"}),
        over("update_sms_negative", {"optim.deferred_update=true", "optim.deferred_update_sms=-1"},
             {"optim.deferred_update_sms must be in [0, 1024]"}),
        raw("moment_dtype_enum", "optim.moment_dtype", "fp16", {"optim.moment_dtype"}),
        over("bf16_moments_beta2", {"optim.moment_dtype=bf16", "optim.beta2=0.999"},
             {"optim.beta2 = 0.999 with optim.moment_dtype = \"bf16\": at most 0.99", "8 significant bits"}),
        over("update_sms_without_deferred", {"optim.deferred_update_sms=16"},
             {"optim.deferred_update_sms = 16 needs optim.deferred_update = true"}),
        over("tokens_paths", {"data.source=tokens"}, {"data.paths must name at least one token file"}),
        RuleCase{"empty_path",
                 [](Config& c) {
                   c.data.paths = {"a.bin", ""};
                 },
                 {"data.paths[1] is an empty string"}},
        RuleCase{"empty_eval_path", [](Config& c) { c.data.eval_paths = {""}; }, {"data.eval_paths[0]"}},
        raw("source_enum", "data.source", "web", {"data.source"}),
        raw("dtype_enum", "data.token_dtype", "int8", {"data.token_dtype"}),
        over("eos_id", {"data.eos_id=256"},
             {"data.eos_id (256) must be a token id in [0, model.vocab_size = 256)"}),
        over("dp", {"parallel.dp=-1"}, {"parallel.dp must be >= 0"}),
        over("ep", {"parallel.ep=0"}, {"parallel.ep must be >= 1"}),
        over("pp", {"parallel.pp=0"}, {"parallel.pp must be >= 1, got 0"}),
        over("pp_too_many_stages", {"model.n_layers=2", "parallel.pp=3"},
             {"parallel.pp x parallel.virtual_stages = 3 x 1 = 3 model stages, but model.n_layers is 2"}),
        over("virtual_stages_without_pp", {"parallel.virtual_stages=2"},
             {"parallel.virtual_stages = 2 needs parallel.pp > 1"}),
        over("pp_layers_count", {"model.n_layers=4", "parallel.pp=2", "parallel.pp_layers=[1,1,2]"},
             {"parallel.pp_layers lists 3 stages, expected parallel.pp x parallel.virtual_stages = 2"}),
        over("pp_layers_sum", {"model.n_layers=4", "parallel.pp=2", "parallel.pp_layers=[1,2]"},
             {"parallel.pp_layers must sum to model.n_layers = 4, got 3"}),
        over("pp_layers_empty_stage", {"model.n_layers=4", "parallel.pp=2", "parallel.pp_layers=[0,4]"},
             {"parallel.pp_layers[0] = 0: every stage needs >= 1 layer"}),
        over("ep_div_dp", {"parallel.dp=4", "parallel.ep=4", "moe.num_experts=12", "parallel.dp=6"},
             {"parallel.ep (4) must divide parallel.dp (6): 6 % 4 = 2"}),
        over("ep_div_experts", {"parallel.ep=3"}, {"moe.num_experts (8) must be divisible by parallel.ep (3)"}),
        raw("ep_backend_enum", "parallel.ep_backend", "x", {"parallel.ep_backend"}),
        over("ckpt_interval", {"checkpoint.interval=-1"}, {"checkpoint.interval must be >= 0"}),
        over("ep_capacity_without_ep", {"parallel.ep_backend=rowwise", "parallel.ep_capacity_factor=1.5"},
             {"parallel.ep_capacity_factor = 1.5 caps the expert-parallel exchange, but parallel.ep = 1"}),
        over("ep_capacity_below_one", {"parallel.ep=2", "parallel.dp=2", "parallel.ep_backend=rowwise", "parallel.ep_capacity_factor=0.5"},
             {"parallel.ep_capacity_factor must be 0 (dropless) or >= 1, got 0.5"}),
        over("ep_capacity_alltoall", {"parallel.ep=2", "parallel.dp=2", "parallel.ep_capacity_factor=1.25"},
             {"parallel.ep_capacity_factor = 1.25 applies to parallel.ep_backend = \"rowwise\" only"}),
        over("ckpt_disabled_interval", {"checkpoint.enabled=false", "checkpoint.interval=5"},
             {"checkpoint.interval = 5", "checkpoint.enabled = false"}),
        over("keep_last", {"checkpoint.keep_last=-1"}, {"checkpoint.keep_last must be >= 0"}),
        over("resume", {"checkpoint.resume="}, {"checkpoint.resume must be"}),
        over("run_dir", {"run.dir="}, {"run.dir must not be empty"}),
        over("log_interval", {"log.interval=0"}, {"log.interval must be >= 1, got 0"}),
        // Upper bounds: values no machine runs are refused naming the key and the bound.
        over("vocab_max", {"model.vocab_size=2147483648"},
             {"model.vocab_size must be <= 2147483647, got 2147483648 (token ids are int32)"}),
        over("d_model_max", {"model.d_model=4294967296"}, {"model.d_model must be <= 65536 (2^16), got 4294967296"}),
        over("n_layers_max", {"model.n_layers=1000000000"},
             {"model.n_layers must be <= 16384 (2^14), got 1000000000"}),
        over("n_heads_max", {"model.n_heads=131072"}, {"model.n_heads must be <= 65536 (2^16)"}),
        over("n_kv_heads_max", {"model.n_kv_heads=131072"}, {"model.n_kv_heads must be <= 65536 (2^16)"}),
        over("dense_hidden_max", {"model.dense_hidden=2097152"}, {"model.dense_hidden must be <= 1048576 (2^20)"}),
        over("num_experts_max", {"moe.num_experts=131072"}, {"moe.num_experts must be <= 65536 (2^16)"}),
        over("expert_hidden_max", {"moe.expert_hidden=2097152"}, {"moe.expert_hidden must be <= 1048576 (2^20)"}),
        over("shared_experts_max", {"moe.shared_experts=2048"}, {"moe.shared_experts must be <= 1024 (2^10)"}),
        over("seq_len_max", {"train.seq_len=576460752303423488"},
             {"train.seq_len must be <= 16777216 (2^24), got 576460752303423488"}),
        over("micro_batch_max", {"train.micro_batch=33554432", "train.global_batch=33554432"},
             {"train.micro_batch must be <= 16777216 (2^24)"}),
        over("global_batch_max", {"train.global_batch=1152921504606846976"},
             {"train.global_batch must be <= 4294967296 (2^32), got 1152921504606846976"}),
        over("steps_max", {"train.steps=4611686018427387904"},
             {"train.steps must be <= 1099511627776 (2^40), got 4611686018427387904"}),
        over("eval_batches_max", {"train.eval_batches=4611686018427387904"},
             {"train.eval_batches must be <= 1048576 (2^20), got 4611686018427387904"}),
        over("dp_max", {"parallel.dp=2097152"}, {"parallel.dp must be <= 1048576 (2^20)"}),
        over("ep_max", {"parallel.ep=2097152"}, {"parallel.ep must be <= 1048576 (2^20)"}),
        over("timeout_max", {"parallel.timeout_s=1e300"}, {"parallel.timeout_s must be <= 31536000.0 seconds"}),
        // What the sizes multiply to.
        over("params_max", {"model.d_model=65536", "model.n_layers=16384", "model.n_heads=64", "model.n_kv_heads=64"},
             {"the model has about", "parameters, more than 281474976710656 (2^48)", "reduce model.n_layers"}),
        over("micro_tokens_max", {"train.seq_len=16777216", "train.micro_batch=512", "train.global_batch=512"},
             {"train.micro_batch x train.seq_len = 512 x 16777216", "tokens per micro-batch, more than 4294967296"}),
        over("step_tokens_max", {"train.seq_len=16777216", "train.global_batch=4294967296"},
             {"train.global_batch x train.seq_len = 4294967296 x 16777216", "tokens per step"}),
        over("activations_max",
             {"train.seq_len=16777216", "train.micro_batch=256", "train.global_batch=256", "moe.num_experts=4096",
              "moe.top_k=4096", "moe.expert_hidden=1048576"},
             {"the activations of one micro-batch are about", "reduce train.micro_batch"})),
    [](const ::testing::TestParamInfo<RuleCase>& info) { return info.param.name; });

TEST(ConfigValidate, BoundaryValuesPass) {
  EXPECT_NO_THROW(validate_config(with({"moe.capacity_factor=1"})));
  EXPECT_NO_THROW(validate_config(with({"moe.capacity_factor=1.25"})));
  EXPECT_NO_THROW(validate_config(with({"moe.top_k=8"})));
  EXPECT_NO_THROW(validate_config(with({"optim.min_lr=0.003"})));
  EXPECT_NO_THROW(validate_config(with({"optim.beta1=0", "optim.grad_clip=0", "optim.warmup_steps=0"})));
  EXPECT_NO_THROW(validate_config(with({"model.dense_layers=", "model.dense_hidden=0"})));  // no dense layer
  EXPECT_NO_THROW(validate_config(with({"model.dense_layers=3,0"})));
  EXPECT_NO_THROW(validate_config(with({"data.source=tokens", "data.paths=a.bin"})));
  EXPECT_NO_THROW(validate_config(with({"parallel.dp=4", "parallel.ep=4", "train.steps=0"})));
  EXPECT_NO_THROW(validate_config(with({"train.eval_interval=0", "train.eval_batches=0"})));
  EXPECT_NO_THROW(validate_config(with({"optim.deferred_update=true", "optim.deferred_update_sms=1024"})));
  EXPECT_NO_THROW(validate_config(with({"optim.moment_dtype=bf16", "optim.beta2=0.99"})));
  EXPECT_NO_THROW(
      validate_config(with({"checkpoint.keep_last=0", "checkpoint.resume=auto", "log.interval=1"})));
}

TEST(ConfigValidate, LargestRealModelsPass) {
  // olmoe-1b-7b-like and far larger: wide, deep, many experts, long sequences.
  EXPECT_NO_THROW(validate_config(with({"model.d_model=16384", "model.n_layers=256", "model.n_heads=128",
                                        "model.n_kv_heads=8", "model.vocab_size=1000000", "moe.num_experts=1024",
                                        "moe.top_k=16", "moe.expert_hidden=4096", "train.seq_len=1048576",
                                        "train.micro_batch=1", "train.global_batch=4096",
                                        "train.steps=100000000"})));
  EXPECT_NO_THROW(validate_config(with({"model.n_layers=16384", "model.dense_layers=", "train.steps=1099511627776"})));
}

TEST(ConfigOverride, QuoteAtOneEndOnlyIsRefused) {
  for (const char* arg : {"--run.dir=\"abc", "--run.dir=abc\"", "--run.dir='abc", "--run.dir=\"", "--run.dir=\"abc'"}) {
    const std::string msg = error_of([&] { with({arg}); });
    EXPECT_CONTAINS(msg, "run.dir: expected a string");
    EXPECT_CONTAINS(msg, "badly quoted");
  }
  for (const char* arg : {"--data.paths=\"a.bin,b.bin", "--data.paths=a.bin,b.bin'"}) {
    const std::string msg = error_of([&] { with({arg}); });
    EXPECT_CONTAINS(msg, "data.paths");
    EXPECT_CONTAINS(msg, "badly quoted");
  }
  EXPECT_EQ(with({"--run.dir=\"a b\""}).run.dir, "a b");
  EXPECT_EQ(with({"--run.dir='x\"y'"}).run.dir, "x\"y");
  EXPECT_EQ(with({"--run.dir=it's"}).run.dir, "it's");
}

TEST(ConfigDifferences, NamesEveryKeyOfTheSectionsWithBothValues) {
  Config a, b;
  EXPECT_TRUE(config_differences(a, b, {"model", "moe"}).empty());
  b.model.n_layers = 1;
  b.model.qk_norm = false;
  b.moe.router = "sigmoid";
  b.model.dense_layers = {0, 1};
  b.train.steps = 3;  // another section: not compared
  const auto d = config_differences(a, b, {"model", "moe"});
  ASSERT_EQ(d.size(), 4u);
  EXPECT_EQ(d[0].key, "model.n_layers");
  EXPECT_EQ(d[0].a, "4");
  EXPECT_EQ(d[0].b, "1");
  EXPECT_EQ(d[1].key, "model.qk_norm");
  EXPECT_EQ(d[2].key, "model.dense_layers");
  EXPECT_EQ(d[2].a, "[0]");
  EXPECT_EQ(d[2].b, "[0, 1]");
  EXPECT_EQ(d[3].key, "moe.router");
  EXPECT_EQ(d[3].b, "\"sigmoid\"");
  EXPECT_EQ(config_differences(a, b, {"train"}).size(), 1u);
}

TEST(ConfigValidate, ReportsEveryProblemAtOnce) {
  const std::string msg = error_of([] {
    validate_config(with({"moe.top_k=0", "log.interval=0", "optim.eps=0"}));
  });
  EXPECT_CONTAINS(msg, "moe.top_k");
  EXPECT_CONTAINS(msg, "log.interval");
  EXPECT_CONTAINS(msg, "optim.eps");
}

// ---------------------------------------------------------------- serialisation

TEST(ConfigToToml, FloatsStayFloatsAndReadable) {
  const std::string text = config_to_toml(Config{});
  EXPECT_CONTAINS(text, "[model]\nvocab_size = 256\n");
  EXPECT_CONTAINS(text, "rope_theta = 10000.0\n");
  EXPECT_CONTAINS(text, "norm_eps = 1e-5\n");
  EXPECT_CONTAINS(text, "dense_layers = [0]\n");
  EXPECT_CONTAINS(text, "capacity_factor = 0.0\n");
  EXPECT_CONTAINS(text, "lr = 0.003\n");
  EXPECT_CONTAINS(text, "eps = 1e-8\n");
  EXPECT_CONTAINS(text, "paths = []\n");
  EXPECT_CONTAINS(text, "router = \"softmax\"\n");
  EXPECT_CONTAINS(text, "\n[log]\ninterval = 10\n");
}

TEST(ConfigToToml, RoundTripOfNonDefaultConfigIsExact) {
  Config c;
  c.model = {.vocab_size = 50304,
             .d_model = 2048,
             .n_layers = 16,
             .n_heads = 16,
             .n_kv_heads = 16,
             .qk_norm = false,
             .rope_theta = 1.0 / 3.0,
             .norm_eps = 1e-300,
             .dense_layers = {},
             .dense_hidden = 1,
             .init_std = 0.1 + 0.2};
  c.moe = {.num_experts = 64,
           .top_k = 8,
           .expert_hidden = 1024,
           .shared_experts = 2,
           .router = "sigmoid",
           .norm_topk_prob = true,
           .lb_loss_weight = 1e300,
           .z_loss_weight = 5e-324,
           .bias_update_rate = 123456789.125,
           .capacity_factor = 1.25,
           .routing = "uniform"};
  c.train = {.seq_len = 4096,
             .micro_batch = 1,
             .global_batch = 1024,
             .steps = 0,
             .seed = 9223372036854775807ull,
             .precision = "fp8",
             .fp8_scaling = "mx",
             .recompute = "full",
             .device = "cuda",
             .eval_interval = 0,
             .eval_batches = 0};
  c.optim = {.lr = 4e-4,
             .min_lr = -0.0,
             .warmup_steps = 2000,
             .schedule = "linear",
             .beta1 = 0.8999999999999999,
             .beta2 = 0.999,
             .eps = 1.5e-8,
             .weight_decay = 0.0,
             .grad_clip = 0.5};
  c.data = {.source = "tokens",
            .paths = {"/data/a b.bin", "quote\"back\\slash", "tab\tnl\n", "\xc3\xa9t\xc3\xa9"},
            .token_dtype = "uint32",
            .eos_id = -7,
            .eval_paths = {"x"},
            .tokenizer = {}};
  c.parallel = {.dp = 8, .ep = 4, .pp = 3, .ep_backend = "rowwise"};
  c.checkpoint = {.dir = "", .interval = 100, .keep_last = 0, .resume = "/ckpt/step_100"};
  c.run.dir = "runs/\x01weird";
  c.log.interval = 1;

  const std::string text = config_to_toml(c);
  const Config back = parse_config_toml(text, "roundtrip.toml");
  EXPECT_EQ(config_to_toml(back), text);
  EXPECT_EQ(back.model.rope_theta, 1.0 / 3.0);
  EXPECT_EQ(back.model.norm_eps, 1e-300);
  EXPECT_EQ(back.model.init_std, 0.1 + 0.2);
  EXPECT_EQ(back.moe.z_loss_weight, 5e-324);
  EXPECT_EQ(back.moe.lb_loss_weight, 1e300);
  EXPECT_TRUE(std::signbit(back.optim.min_lr));
  EXPECT_EQ(back.optim.beta1, 0.8999999999999999);
  EXPECT_EQ(back.train.seed, 9223372036854775807ull);
  EXPECT_EQ(back.data.paths, c.data.paths);
  EXPECT_EQ(back.run.dir, c.run.dir);
  EXPECT_TRUE(back.model.dense_layers.empty());
  EXPECT_NE(text, config_to_toml(Config{}));
}

TEST(ConfigToToml, EveryKeyChangesItsLine) {
  // Flipping any one key through the table changes the TOML and parses back to the same text.
  for (const auto& k : config_keys()) {
    Config c;
    std::visit(
        [](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, bool>)
            *p = !*p;
          else if constexpr (std::is_same_v<T, std::string>)
            *p += "_x";
          else if constexpr (std::is_same_v<T, std::vector<std::string>> ||
                             std::is_same_v<T, std::vector<int64_t>>)
            p->push_back({});
          else if constexpr (std::is_same_v<T, std::vector<DataSourceConfig>>)
            p->push_back({{"x.npy"}, 2.0});
          else
            *p = *p + 3;
        },
        k.field(c));
    const std::string text = config_to_toml(c);
    EXPECT_NE(text, config_to_toml(Config{})) << k.name;
    if (!k.choices.empty()) continue;  // "softmax_x" is not a choice; the parser rejects it by design
    EXPECT_EQ(config_to_toml(parse_config_toml(text, k.name)), text) << k.name;
  }
}

TEST(ConfigHelp, ListsEveryKeyWithTypeDefaultAndChoices) {
  const std::string help = config_help();
  for (const auto& k : config_keys()) {
    EXPECT_CONTAINS(help, k.name);
    EXPECT_CONTAINS(help, k.description);
  }
  EXPECT_CONTAINS(help, "[moe]");
  EXPECT_CONTAINS(help, "router score function; one of: softmax, sigmoid");
  EXPECT_CONTAINS(help, "\"runs/default\"");
  EXPECT_CONTAINS(help, "int list");
  EXPECT_CONTAINS(help, "--section.key=value");
}

}  // namespace
}  // namespace moe::testing

namespace moe {
namespace {

TEST(ConfigValidate, LogTraceIsAStepRangeWithinTrainSteps) {
  for (const char* ok : {"2:3", "1:1", "5", " 2 : 4 "}) {
    Config c;
    c.train.steps = 10;
    c.log.trace = ok;
    EXPECT_NO_THROW(validate_config(c)) << ok;
  }
  for (const char* bad : {"x", "3:2", "0:1", "1:11", "2:", ":3", "-1:2", "1:2:3", "1e2", "11"}) {
    Config c;
    c.train.steps = 10;
    c.log.trace = bad;
    std::string msg;
    try {
      validate_config(c);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("log.trace"), std::string::npos) << bad << ": " << msg;
  }
  Config c;
  c.log.trace = "9:9";
  apply_override(c, "--log.trace=2:3");
  EXPECT_EQ(c.log.trace, "2:3");
  apply_override(c, "--log.phase_times=true");
  EXPECT_TRUE(c.log.phase_times);
}

}  // namespace
}  // namespace moe
