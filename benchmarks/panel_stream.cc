// What a decoding step's matrix products cost on this CPU as the rows grow, outside XLA: the packed-panel product of
// pallas_kernels/cpu.cc (included: its own register tiles and prefetch) over the default model's weight shapes
// (30 layers' q/k/v, o, gate/up and down, and the LM head: 538 MB of float32 panels, values arbitrary), split over
// two threads by panels.
// Two ways, interleaved, medians of 8 timed rounds:
//   kernel    the kernel's tiles (kPanelRows rows, then kRestRows) over the model's panels
//   compute   the same tiles, every product reading one small panel that stays cached: the arithmetic alone
// A pass whose time is the kernel's memory pass (rows = 1) plus the compute column's growth adds its arithmetic to
// the weight stream rather than hiding it under it.
//
//   inc=$(.venv/bin/python -c 'import jax; print(jax.ffi.include_dir())')
//   g++ -O3 -march=native -std=gnu++17 -pthread -w -I"$inc" benchmarks/panel_stream.cc -o /tmp/panel_stream
//   /tmp/panel_stream > benchmarks/results/panel_stream_cpu.json
// An optional argument lists the rows per pass (`/tmp/panel_stream 1,2,4`); benchmarks/prefetch_sweep.py builds this
// with the kernel's prefetch settings (or its tile height, SPECFORMER_PANEL_ROWS) overridden.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../pallas_kernels/cpu.cc"

struct Matrix { int K, N; std::vector<float> panels; };
enum Way { kKernel, kCompute, kWays };
const char* kNames[kWays] = {"kernel", "compute"};

void product(Way way, const float* x, int M, const Matrix& w, const float* cached, float* y, int p0, int p1) {
  if (way == kKernel) return packed_units(x, M, w.K, w.panels.data(), y, w.N, p0, p1);
  for (int p = p0; p < p1; ++p) panel_product(x, M, w.K, cached, y + p * kPanel, w.N);
}

// The second thread: runs `work` each time `generation` moves on, then reports it done.
struct Helper {
  std::atomic<int> generation{0}, finished{0};
  std::function<void()> work;
  std::thread thread{[this] {
    for (int seen = 0;;) {
      int g;
      while ((g = generation.load(std::memory_order_acquire)) == seen) {}
      if (g < 0) return;
      work();
      finished.store(seen = g, std::memory_order_release);
    }
  }};
  void both(const std::function<void()>& mine, std::function<void()> theirs) {
    work = std::move(theirs);
    const int g = generation.load() + 1;
    generation.store(g, std::memory_order_release);
    mine();
    while (finished.load(std::memory_order_acquire) != g) {}
  }
  ~Helper() { generation.store(-1); thread.join(); }
};

// The CPU's model name (/proc/cpuinfo), for the result's record of its device.
std::string cpu_model() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  char line[512];
  std::string model = "unknown";
  while (f && std::fgets(line, sizeof(line), f))
    if (std::strncmp(line, "model name", 10) == 0) {
      model = std::strchr(line, ':') + 2;
      model.erase(model.find_last_not_of(" \n") + 1);
      break;
    }
  if (f) std::fclose(f);
  return model;
}

// Row counts from "1,4,8" (argv[1]), or the default list.
std::vector<int> row_counts(int argc, char** argv) {
  if (argc < 2) return {1, 4, 8, 12, 14, 16, 24, 64};
  std::vector<int> counts;
  for (const char* p = argv[1]; *p;) {
    char* end;
    const long n = std::strtol(p, &end, 10);
    if (end == p || n < 1 || n > 64) {
      std::fprintf(stderr, "panel_stream: rows must be a comma-separated list of 1-64, got '%s'\n", argv[1]);
      std::exit(2);
    }
    counts.push_back(static_cast<int>(n));
    p = *end == ',' ? end + 1 : end;
  }
  return counts;
}

int main(int argc, char** argv) {
  const int shapes[4][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}};
  std::vector<Matrix> matrices;
  for (int layer = 0; layer < 30; ++layer)
    for (const auto& s : shapes) matrices.push_back({s[0], s[1], std::vector<float>(size_t(s[0]) * s[1])});
  matrices.push_back({576, 49152, std::vector<float>(576ul * 49152)});
  for (auto& m : matrices)
    for (size_t i = 0; i < m.panels.size(); ++i) m.panels[i] = float((i * 2654435761u) % 1000) * 1e-4f;
  std::vector<float> cached(1536 * kPanel, 1e-3f), x(64 * 1536, 1e-2f), y(64 * 49152);
  const std::vector<int> counts = row_counts(argc, argv);
  const int kCounts = static_cast<int>(counts.size());
  std::vector<std::vector<double>> ms[kWays];
  for (auto& way : ms) way.resize(kCounts);
  Helper helper;
  for (int round = 0; round < 9; ++round)  // the first untimed
    for (int c = 0; c < kCounts; ++c)
      for (int way = 0; way < kWays; ++way) {
        const auto start = std::chrono::steady_clock::now();
        for (const auto& m : matrices) {
          const int panels = m.N / kPanel, half = panels / 2;
          auto part = [&, way](int p0, int p1) {
            product(Way(way), x.data(), counts[c], m, cached.data(), y.data(), p0, p1);
          };
          helper.both([&] { part(0, half); }, [&] { part(half, panels); });
        }
        const std::chrono::duration<double, std::milli> took = std::chrono::steady_clock::now() - start;
        if (round) ms[way][c].push_back(took.count());
      }
  std::printf("{\n \"command\": \"g++ -O3 -march=native -std=gnu++17 -pthread -w -I$inc benchmarks/panel_stream.cc"
              " -o /tmp/panel_stream && /tmp/panel_stream\",\n");
  std::printf(" \"device\": \"%s\",\n \"cpu_count\": %u,\n \"compiler\": \"%s\",\n", cpu_model().c_str(),
              std::thread::hardware_concurrency(), __VERSION__);
  std::printf(" \"lanes\": %d,\n \"tile_rows\": %d,\n \"rest_rows\": %d,\n \"rest_vecs\": %d,\n", kLanes,
              kPanelRows, kRestRows, kRestVecs);
  std::printf(" \"unit\": \"ms per pass over every matrix, median of 8\",\n \"rows\": {\n");
  for (int c = 0; c < kCounts; ++c) {
    std::printf("  \"%d\": {", counts[c]);
    for (int way = 0; way < kWays; ++way) {
      auto v = ms[way][c];
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      std::printf("\"%s\": %.2f%s", kNames[way], v[v.size() / 2], way + 1 < kWays ? ", " : "");
    }
    std::printf("}%s\n", c + 1 < kCounts ? "," : "");
  }
  std::printf(" }\n}\n");
}
