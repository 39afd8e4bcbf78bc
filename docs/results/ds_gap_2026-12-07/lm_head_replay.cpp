// The LM head GEMV (32000 x 512 float32, packed panels) alone: the packed kernel, hand GEMVs
// with and without software prefetch, and a plain read, caches flushed before each. Build as
// moe_replay.cpp, run with OMP_NUM_THREADS=1.
#include "packed_gemm.h"
#include <chrono>
#include <cstdio>
using namespace pagedllm;
template<int PD>
void gemv_pf(const float* x,const float* w,int64_t K,int64_t N,float* y){
  const int64_t ps=16*K; const int64_t total=N*K;
  for(int64_t p=0;p<N/16;++p){const float* wp=w+p*ps; __m256 a0=_mm256_setzero_ps(),a1=a0,b0=a0,b1=a0;
    for(int64_t k=0;k<K;k+=2){ if(PD>0 && p*ps+k*16+PD/4<total) _mm_prefetch((const char*)(wp+k*16)+PD,_MM_HINT_T0);
      __m256 xv=_mm256_broadcast_ss(x+k); a0=_mm256_fmadd_ps(xv,_mm256_loadu_ps(wp+k*16),a0); a1=_mm256_fmadd_ps(xv,_mm256_loadu_ps(wp+k*16+8),a1);
      if(PD>0 && p*ps+k*16+16+PD/4<total) _mm_prefetch((const char*)(wp+k*16+16)+PD,_MM_HINT_T0);
      __m256 xw=_mm256_broadcast_ss(x+k+1); b0=_mm256_fmadd_ps(xw,_mm256_loadu_ps(wp+k*16+16),b0); b1=_mm256_fmadd_ps(xw,_mm256_loadu_ps(wp+k*16+24),b1);}
    _mm256_storeu_ps(y+p*16,_mm256_add_ps(a0,b0));_mm256_storeu_ps(y+p*16+8,_mm256_add_ps(a1,b1));}
}
int main(){const int64_t N=32000,K=512; float* w=new float[N*K]; for(int64_t i=0;i<N*K;++i)w[i]=1e-3f*(i%11);
  std::vector<float> x(K,0.5f),y(N); float* big=new float[64<<20]; for(int64_t i=0;i<(64<<20);++i)big[i]=1;
  double b[5]={1e9,1e9,1e9,1e9,1e9};
  for(int rep=0;rep<15;++rep){
    for(int v=0;v<5;++v){ float s=0; for(int64_t i=0;i<(64<<20);i+=16)s+=big[i]; if(s<0)printf("x");  // flush caches
      auto t0=std::chrono::steady_clock::now();
      if(v==0) packed::linear<float,float,float>(x.data(),K,1,K,w,N,nullptr,y.data(),N);
      else if(v==1) gemv_pf<0>(x.data(),w,K,N,y.data());
      else if(v==2) gemv_pf<1024>(x.data(),w,K,N,y.data());
      else if(v==3) gemv_pf<2048>(x.data(),w,K,N,y.data());
      else {__m256 s=_mm256_setzero_ps(),s2=s; for(int64_t i=0;i<N*K;i+=16){s=_mm256_add_ps(s,_mm256_loadu_ps(w+i));s2=_mm256_add_ps(s2,_mm256_loadu_ps(w+i+8));} volatile float q=hsum(_mm256_add_ps(s,s2));(void)q;}
      b[v]=std::min(b[v],std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count());}}
  const char* nm[5]={"packed_main","2acc_nopf","2acc_pf1K","2acc_pf2K","plainread"};
  for(int v=0;v<5;++v)printf("%s %.3f ms (%.1f GB/s)  ",nm[v],b[v]*1e3,N*K*4/b[v]/1e9); printf("\n");}
