// Replay of a single-thread batch-1 decode token's routed experts of deepseek-v2-lite-200m (7 MoE
// layers x 6 of 64 experts, H 512, I 224, float32): the 64-column tiles ("tiles", before),
// whole-matrix tiles ("whole", after) and a plain read of the same bytes; D*: a hand GEMV with
// linear prefetch distances (not adopted). Build: g++ -O3 -mavx2 -mfma -fopenmp -DPAGEDLLM_AVX2
// -I pagedllm/native/kernels/csrc moe_replay.cpp
#include "fused_moe_kernel.h"
#include <chrono>
#include <cstdio>
#include <random>
using namespace pagedllm;

template<int PD>
void gemv_pf(const float* x,const float* w,int64_t K,int64_t n,float* y,const float* next){
  // n rows of K, 4 at a time; prefetch PD bytes ahead linearly; near the end, prefetch `next`.
  const char* base=(const char*)w; const int64_t bytes=n*K*4;
  int64_t j=0;
  for(;j+4<=n;j+=4){
    __m256 a[4],b[4];for(int r=0;r<4;++r)a[r]=b[r]=_mm256_setzero_ps();
    const float* wj=w+j*K;
    for(int64_t k=0;k<K;k+=16){
      for(int r=0;r<4;++r){int64_t off=((j+r)*K+k)*4+PD; const char* p= off<bytes? base+off : (next? (const char*)next+(off-bytes): nullptr); if(p)_mm_prefetch(p,_MM_HINT_T0);}
      __m256 x0=_mm256_loadu_ps(x+k),x1=_mm256_loadu_ps(x+k+8);
      for(int r=0;r<4;++r){a[r]=_mm256_fmadd_ps(x0,_mm256_loadu_ps(wj+r*K+k),a[r]);b[r]=_mm256_fmadd_ps(x1,_mm256_loadu_ps(wj+r*K+k+8),b[r]);}
    }
    for(int r=0;r<4;++r)y[j+r]=hsum(_mm256_add_ps(a[r],b[r]));
  }
  for(;j<n;++j){float s=0;for(int64_t k=0;k<K;++k)s+=x[k]*w[j*K+k];y[j]=s;}
}
template<int PD> double runD(std::vector<float*>&w13,std::vector<float*>&w2,int64_t ids[][6],int L,int64_t I,int64_t H,std::vector<float>&x,std::vector<float>&act,std::vector<float>&ys,bool nx){
  std::vector<float> gu(2*I);
  auto t0=std::chrono::steady_clock::now();
  for(int l=0;l<L;++l)for(int j=0;j<6;++j){int64_t e=ids[l][j];
    gemv_pf<PD>(x.data(),w13[l]+e*2*I*H,H,2*I,gu.data(),nx? w2[l]+e*H*I:nullptr);
    for(int i=0;i<I;++i)act[j*I+i]=moe::silu(gu[i])*gu[I+i];
    const float* nxt=nullptr; if(nx){ if(j<5) nxt=w13[l]+ids[l][j+1]*2*I*H; }
    gemv_pf<PD>(act.data()+j*I,w2[l]+e*H*I,I,H,ys.data()+j*H,nxt);}
  return std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();
}
int main(){
  const int64_t E=64,H=512,I=224,L=7;
  std::vector<float*> w13(L), w2(L);
  for(int l=0;l<L;++l){w13[l]=new float[E*2*I*H];w2[l]=new float[E*H*I];
    for(int64_t i=0;i<E*2*I*H;++i)w13[l][i]=1e-3f*(i%7);for(int64_t i=0;i<E*H*I;++i)w2[l][i]=1e-3f*(i%5);}
  std::vector<float> x(H,0.5f),act(6*I),ys(6*H),g(64),u(64);
  std::mt19937 rng(1);
  double bd[8]={1e9,1e9,1e9,1e9,1e9,1e9,1e9,1e9}; double best_a=1e9,best_b=1e9,best_c=1e9;
  for(int rep=0;rep<30;++rep){
    int64_t ids[L][6];for(int l=0;l<L;++l){for(int j=0;j<6;++j)ids[l][j]=(rng()%10)*6+j;}
    // A: current tile scheme (rows=1)
    auto t0=std::chrono::steady_clock::now();
    for(int l=0;l<L;++l)for(int j=0;j<6;++j){int64_t e=ids[l][j];
      for(int64_t n0=0;n0<I;n0+=64){int64_t n=std::min(I,n0+64)-n0;const float*wg=w13[l]+(e*2*I+n0)*H;
        moe::tile_gemm(x.data(),H,1,wg,H,n,g.data(),64);moe::tile_gemm(x.data(),H,1,wg+I*H,H,n,u.data(),64);
        for(int i=0;i<n;++i)act[j*I+n0+i]=moe::silu(g[i])*u[i];}
      for(int64_t n0=0;n0<H;n0+=64)moe::tile_gemm(act.data()+j*I,I,1,w2[l]+(e*H+n0)*I,I,64,ys.data()+j*H+n0,H);}
    auto t1=std::chrono::steady_clock::now();
    // B: whole matrices per expert (gate all, up all, down all)
    std::vector<float> G(I),U(I);
    for(int l=0;l<L;++l)for(int j=0;j<6;++j){int64_t e=ids[l][j];const float*wg=w13[l]+e*2*I*H;
      moe::tile_gemm(x.data(),H,1,wg,H,2*I,act.data(),1); // placeholder overwritten
      moe::tile_gemm(act.data()+j*I,I,1,w2[l]+e*H*I,I,H,ys.data()+j*H,H);}
    auto t2=std::chrono::steady_clock::now();
    // C: plain read of same bytes
    __m256 s=_mm256_setzero_ps();
    for(int l=0;l<L;++l)for(int j=0;j<6;++j){int64_t e=ids[l][j];const float*a=w13[l]+e*2*I*H;const float*b=w2[l]+e*H*I;
      for(int64_t i=0;i<2*I*H;i+=8)s=_mm256_add_ps(s,_mm256_loadu_ps(a+i));for(int64_t i=0;i<H*I;i+=8)s=_mm256_add_ps(s,_mm256_loadu_ps(b+i));}
    auto t3=std::chrono::steady_clock::now();
    volatile float sink=hsum(s);(void)sink;
    for(int v=0;v<8;++v){double t; switch(v){case 0:t=runD<512>(w13,w2,ids,L,I,H,x,act,ys,false);break;case 1:t=runD<1024>(w13,w2,ids,L,I,H,x,act,ys,false);break;case 2:t=runD<2048>(w13,w2,ids,L,I,H,x,act,ys,false);break;case 3:t=runD<4096>(w13,w2,ids,L,I,H,x,act,ys,false);break;case 4:t=runD<512>(w13,w2,ids,L,I,H,x,act,ys,true);break;case 5:t=runD<1024>(w13,w2,ids,L,I,H,x,act,ys,true);break;case 6:t=runD<2048>(w13,w2,ids,L,I,H,x,act,ys,true);break;default:t=runD<4096>(w13,w2,ids,L,I,H,x,act,ys,true);} bd[v]=std::min(bd[v],t);}
    best_a=std::min(best_a,std::chrono::duration<double>(t1-t0).count());
    best_b=std::min(best_b,std::chrono::duration<double>(t2-t1).count());
    best_c=std::min(best_c,std::chrono::duration<double>(t3-t2).count());
  }
  for(int v=0;v<8;++v)printf("D%d %.3f ms  ",v,bd[v]*1e3); printf("\n");
  double mb=L*6*3*I*H*4/1e6;
  printf("MB %.1f  tiles %.3f ms (%.1f GB/s)  whole %.3f ms (%.1f GB/s)  plainread %.3f ms (%.1f GB/s)\n",mb,best_a*1e3,mb/best_a/1e3,best_b*1e3,mb/best_b/1e3,best_c*1e3,mb/best_c/1e3);
}
