// A/B of two rate_lib builds in one process: alternated rounds, thread CPU per call (best of REPS
// calls per round and library), outputs compared (max |A - B|).
//   rate_main ds|qn BF16(0|1) ROUNDS REPS A.so B.so [T [E K]]
// ds: DeepSeek-V2-Lite 200M's experts (64 x 224 x 512, top-6), qn: Qwen3-Next 200M's (16 x 256 x
// 768, top-2), T tokens (1365: one prefill step of 32 x 128 prompts); env NL: weight copies cycled.
#include <dlfcn.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <random>
#include <vector>
#include <algorithm>
#include <cmath>
typedef double (*fn_t)(int, const void*, const void*, const void*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, void*);
static uint16_t bf(float f){uint32_t u; memcpy(&u,&f,4); u += 0x7fff + ((u>>16)&1); return u>>16;}
static float fb(uint16_t h){uint32_t u=(uint32_t)h<<16; float f; memcpy(&f,&u,4); return f;}
int main(int argc, char** argv) {
  const char* which = argv[1]; int bf16 = atoi(argv[2]); int rounds = atoi(argv[3]); int reps = atoi(argv[4]);
  int64_t T = 1365, E, I, H, k;
  if (!strcmp(which, "ds")) { E = 64; I = 224; H = 512; k = 6; } else { E = 16; I = 256; H = 768; k = 2; }
  if (argc > 7) T = atoi(argv[7]);
  if (argc > 9) { E = atoi(argv[8]); k = atoi(argv[9]); }
  void* la = dlopen(argv[5], RTLD_NOW | RTLD_LOCAL); void* lb = dlopen(argv[6], RTLD_NOW | RTLD_LOCAL);
  if (!la || !lb) { fprintf(stderr, "%s\n", dlerror()); return 1; }
  fn_t fa = (fn_t)dlsym(la, "run_experts"), fbb = (fn_t)dlsym(lb, "run_experts");
  std::mt19937 g(0); std::normal_distribution<float> nd;
  size_t es = bf16 ? 2 : 4;
  int NL = getenv("NL") ? atoi(getenv("NL")) : 1;
  std::vector<char> w13(NL*E*2*I*H*es), w2(NL*E*H*I*es), x(T*H*es);
  auto fill = [&](std::vector<char>& v, float s) { size_t n = v.size()/es; for (size_t i=0;i<n;++i){ float f = ((int)((i * 2654435761u) >> 7 & 1023) - 511.5f) * s / 295.f; if (bf16) ((uint16_t*)v.data())[i]=bf(f); else ((float*)v.data())[i]=f; } };
  fill(w13, 0.04f); fill(w2, 0.06f); fill(x, 1.f);
  std::vector<int64_t> ids(T*k); std::uniform_int_distribution<int> ud(0, E-1);
  for (int64_t t = 0; t < T; ++t) for (int64_t j = 0; j < k; ++j) { int64_t e; bool dup; do { e = ud(g); dup=false; for (int64_t q=0;q<j;++q) dup |= ids[t*k+q]==e; } while(dup); ids[t*k+j]=e; }
  std::vector<char> ya(T*k*H*es), yb(T*k*H*es);
  fa(bf16, x.data(), w13.data(), w2.data(), ids.data(), T, E, I, H, k, ya.data());
  fbb(bf16, x.data(), w13.data(), w2.data(), ids.data(), T, E, I, H, k, yb.data());
  double md = 0, mx = 0; size_t n = T*k*H;
  for (size_t i = 0; i < n; ++i) { double a = bf16 ? fb(((uint16_t*)ya.data())[i]) : ((float*)ya.data())[i]; double b = bf16 ? fb(((uint16_t*)yb.data())[i]) : ((float*)yb.data())[i]; md = std::max(md, std::fabs(a-b)); mx = std::max(mx, std::fabs(a)); }
  double gmac = T*k*3.0*I*H/1e9;
  std::vector<double> ra, rb, ratio;
  for (int r = 0; r < rounds; ++r) {
    double ba = 1e9, bb = 1e9;
    for (int q = 0; q < reps; ++q) ba = std::min(ba, fa(bf16, x.data(), w13.data() + (q % NL) * E*2*I*H*es, w2.data() + (q % NL) * E*H*I*es, ids.data(), T, E, I, H, k, nullptr));
    for (int q = 0; q < reps; ++q) bb = std::min(bb, fbb(bf16, x.data(), w13.data() + (q % NL) * E*2*I*H*es, w2.data() + (q % NL) * E*H*I*es, ids.data(), T, E, I, H, k, nullptr));
    ra.push_back(ba); rb.push_back(bb); ratio.push_back(bb/ba);
    printf("  round %d: A %.2f ms (%.1f GMAC/s)  B %.2f ms (%.1f GMAC/s)  B/A %.3f\n", r, ba*1e3, gmac/ba, bb*1e3, gmac/bb, bb/ba);
  }
  std::sort(ratio.begin(), ratio.end());
  double lavg[3]; getloadavg(lavg, 3);
  printf("%s %s T=%ld: best A %.2f ms (%.1f GMAC/s), best B %.2f ms (%.1f GMAC/s), median B/A %.3f, max|A-B| %.3g (max|A| %.3g), load %.2f\n",
         which, bf16 ? "bf16" : "fp32", (long)T, *std::min_element(ra.begin(), ra.end())*1e3, gmac/ *std::min_element(ra.begin(), ra.end()),
         *std::min_element(rb.begin(), rb.end())*1e3, gmac/ *std::min_element(rb.begin(), rb.end()), ratio[ratio.size()/2], md, mx, lavg[0]);
}
