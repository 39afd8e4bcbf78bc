#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t total=(size_t)1<<30; float*a=aligned_alloc(64,total);
  for(size_t i=0;i<total/4;i++)a[i]=1.0f;
  size_t sizes_mb[]={1,16,64,128,192,256,384,512,1024};
  for(int s=0;s<9;s++){
    size_t n=sizes_mb[s]<<20; n/=4; if(n*4>total) n=total/4;
    int reps = (int)(2048/sizes_mb[s]); if(reps<3)reps=3;
    __m512 acc0=_mm512_setzero_ps(),acc1=acc0,acc2=acc0,acc3=acc0;
    // warm
    for(size_t i=0;i<n;i+=64){acc0=_mm512_add_ps(acc0,_mm512_load_ps(a+i));}
    double t=now();
    for(int r=0;r<reps;r++){
      for(size_t i=0;i<n;i+=64){
        acc0=_mm512_add_ps(acc0,_mm512_load_ps(a+i));
        acc1=_mm512_add_ps(acc1,_mm512_load_ps(a+i+16));
        acc2=_mm512_add_ps(acc2,_mm512_load_ps(a+i+32));
        acc3=_mm512_add_ps(acc3,_mm512_load_ps(a+i+48));
      }
    }
    double dt=now()-t;
    float out=_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0,acc1),_mm512_add_ps(acc2,acc3)));
    printf("%5zu MB: %.1f GB/s (%g)\n",sizes_mb[s],(double)n*4*reps/dt/1e9,out>0?1.0:0.0);
  }
}
