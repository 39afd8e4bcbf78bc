// Read patterns over 400 matrices of 672 x 512 float32 (~550 MB, more than the LLC): a sequential
// read with a 4 KiB software prefetch, and the few-row kernel's dot products (MB x rows of x, NB
// weight rows at once) with its row-ahead prefetch ('rowpf') or a linear cursor ('cur<D>').
// g++ -O3 -march=native -std=c++17 -Ipagedllm/native/kernels/csrc read_patterns.cpp
#include "cpu_vec.h"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
using namespace pagedllm;
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
// MB x rows against weight rows: the kernel's form (NB rows in parallel, prefetch row j+NB at k)
template<int MB,int NB,int MODE,int PF>
inline void micro(const float* x,int64_t ldx,const float* w,int64_t K,float* y,int64_t ldy,const char*& cur){
  __m512 acc[MB][NB];
  for(int i=0;i<MB;++i)for(int j=0;j<NB;++j)acc[i][j]=_mm512_setzero_ps();
  for(int64_t k=0;k<K;k+=16){
    if(MODE==0){for(int j=0;j<NB;++j)_mm_prefetch((const char*)(w+(j+NB)*K+k),_MM_HINT_T0);}
    else if(MODE==1){for(int j=0;j<NB;++j){_mm_prefetch(cur+PF,_MM_HINT_T0);cur+=64;}}
    __m512 wv[NB];for(int j=0;j<NB;++j)wv[j]=_mm512_loadu_ps(w+j*K+k);
    for(int i=0;i<MB;++i){const __m512 xv=_mm512_loadu_ps(x+i*ldx+k);for(int j=0;j<NB;++j)acc[i][j]=_mm512_fmadd_ps(xv,wv[j],acc[i][j]);}
  }
  for(int i=0;i<MB;++i)for(int j=0;j<NB;++j)y[i*ldy+j]=hsum(acc[i][j]);
}
template<int MB,int NB,int MODE,int PF>
void gemm(const float* x,int64_t ldx,const float* w,int64_t K,int64_t n,float* y,int64_t ldy){
  const char* cur=(const char*)w; int64_t j=0;
  for(;j+NB<=n;j+=NB)micro<MB,NB,MODE,PF>(x,ldx,w+j*K,K,y+j,ldy,cur);
  for(;j<n;++j)micro<MB,1,MODE,PF>(x,ldx,w+j*K,K,y+j,ldy,cur);
}
float seq(const float* p,int64_t n){__m512 s0=_mm512_setzero_ps(),s1=s0,s2=s0,s3=s0;
 for(int64_t i=0;i<n;i+=64){ _mm_prefetch((const char*)(p+i)+4096,_MM_HINT_T0);
  s0=_mm512_add_ps(s0,_mm512_loadu_ps(p+i));s1=_mm512_add_ps(s1,_mm512_loadu_ps(p+i+16));s2=_mm512_add_ps(s2,_mm512_loadu_ps(p+i+32));s3=_mm512_add_ps(s3,_mm512_loadu_ps(p+i+48));}
 return hsum(_mm512_add_ps(_mm512_add_ps(s0,s1),_mm512_add_ps(s2,s3)));}
int main(int argc,char**argv){
 const int64_t K=512, R=448*3/2*0+672, M=400; // matrices of 672 rows (gate+up+down-equivalent bytes) x 512
 std::vector<float> buf((size_t)M*R*K); for(size_t i=0;i<buf.size();++i)buf[i]=(i%13)*1e-3f;
 std::vector<float> x(12*K,0.5f),y(12*R);
 const double bytes=(double)buf.size()*4; float sink=0;
 const char* names[]={"seq+pf4K","k3x6 rowpf","k3x6 cur4K","k3x6 cur8K","k3x6 cur16K","k3x1 cur4K","k3x1 cur8K","k1x6 rowpf","k1x1 cur4K","k6x4 rowpf","k6x4 cur8K"};
 const int NV=11; std::vector<std::vector<double>> t(NV);
 for(int rep=0;rep<15;++rep){
  for(int vv=0;vv<NV;++vv){int v=(vv+rep)%NV; double a=now();
   for(int64_t m=0;m<M;++m){const float* w=buf.data()+m*R*K;
    switch(v){case 0:sink+=seq(w,R*K);break;
     case 1:gemm<3,6,0,0>(x.data(),K,w,K,R,y.data(),R);break;
     case 2:gemm<3,6,1,4096>(x.data(),K,w,K,R,y.data(),R);break;
     case 3:gemm<3,6,1,8192>(x.data(),K,w,K,R,y.data(),R);break;
     case 4:gemm<3,6,1,16384>(x.data(),K,w,K,R,y.data(),R);break;
     case 5:gemm<3,1,1,4096>(x.data(),K,w,K,R,y.data(),R);break;
     case 6:gemm<3,1,1,8192>(x.data(),K,w,K,R,y.data(),R);break;
     case 7:gemm<1,6,0,0>(x.data(),K,w,K,R,y.data(),R);break;
     case 8:gemm<1,1,1,4096>(x.data(),K,w,K,R,y.data(),R);break;
     case 9:gemm<6,4,0,0>(x.data(),K,w,K,R,y.data(),R);break;
     case 10:gemm<6,4,1,8192>(x.data(),K,w,K,R,y.data(),R);break;}
    sink+=y[5];}
   t[v].push_back(now()-a);}
 }
 for(int v=0;v<NV;++v){std::sort(t[v].begin(),t[v].end()); printf("%-12s median %.1f GB/s  best %.1f\n",names[v],bytes/t[v][7]/1e9,bytes/t[v][0]/1e9);}
 printf("%g\n",sink);
}
