// A batch-32 decode step's routed experts (61 experts x 3 rows; R=1, 2 likewise): 64-column
// tiles against whole-matrix tiles. Build as moe_replay.cpp.
#include "fused_moe_kernel.h"
#include <chrono>
#include <cstdio>
using namespace pagedllm;
int main(){const int64_t E=64,H=512,I=224,R=3; float* w13=new float[E*2*I*H]; float* w2=new float[E*H*I];
  for(int64_t i=0;i<E*2*I*H;++i)w13[i]=1e-3f*(i%7); for(int64_t i=0;i<E*H*I;++i)w2[i]=1e-3f*(i%5);
  std::vector<float> x(R*H,0.5f),act(R*I),ys(R*H),g(R*I),u(R*I); double bt[2]={1e9,1e9};
  for(int rep=0;rep<20;++rep)for(int v=0;v<2;++v){const int64_t T=v==0?64:I, TH=v==0?64:H;
    auto t0=std::chrono::steady_clock::now();
    for(int64_t e=0;e<61;++e){
      for(int64_t n0=0;n0<I;n0+=T){int64_t n=std::min(I,n0+T)-n0;const float*wg=w13+(e*2*I+n0)*H;
        moe::tile_gemm(x.data(),H,R,wg,H,n,g.data(),T);moe::tile_gemm(x.data(),H,R,wg+I*H,H,n,u.data(),T);
        for(int r=0;r<R;++r)for(int i=0;i<n;++i)act[r*I+n0+i]=moe::silu(g[r*T+i])*u[r*T+i];}
      for(int64_t n0=0;n0<H;n0+=TH)moe::tile_gemm(act.data(),I,R,w2+(e*H+n0)*I,I,std::min(H,n0+TH)-n0,ys.data()+n0,H);}
    bt[v]=std::min(bt[v],std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count());}
  printf("3 rows x 61 experts: 64-col tiles %.3f ms, whole %.3f ms\n",bt[0]*1e3,bt[1]*1e3);}
