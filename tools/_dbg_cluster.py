import sys
import mlx.core as mx, numpy as np
from attn_kernels import decode_attention_custom, scaled_dot_product_attention
mx.set_default_device(mx.gpu)
scheds = sys.argv[1].split(",")
def f64(q,k,v,L):
    q,k,v=[np.array(x.astype(mx.float32)).astype(np.float64) for x in (q,k,v)]
    b,hq,_,d=q.shape; hkv=k.shape[1]; S=k.shape[2]
    kk=np.repeat(k,hq//hkv,axis=1); vv=np.repeat(v,hq//hkv,axis=1)
    s=q@kk.transpose(0,1,3,2)/np.sqrt(d)
    if L>1: s=s+np.where(np.arange(S)[None,:]>np.arange(L)[:,None]+S-L,-np.inf,0)
    s=np.exp(s-s.max(-1,keepdims=True)); s/=s.sum(-1,keepdims=True)
    return s@vv
for dtype in (mx.bfloat16,):
    for (b, hq, hkv, L) in [(1,32,8,1),(2,4,4,1),(1,8,2,1),(1,32,8,2)]:
        row=[]
        for S in (65, 127, 200, 600, 1024):
            ks = mx.random.split(mx.random.key(S+hq), 3)
            q = mx.random.normal((b,hq,L,128), key=ks[0]).astype(dtype)
            k = mx.random.normal((b,hkv,S,128), key=ks[1]).astype(dtype)
            v = mx.random.normal((b,hkv,S,128), key=ks[2]).astype(dtype)
            mx.eval(q,k,v)
            ref=f64(q,k,v,L)
            errs=[]
            for sch in scheds:
                if sch=="oracle": o=scaled_dot_product_attention(q,k,v,mask="causal" if L>1 else None)
                else: o = decode_attention_custom(q,k,v,mask="causal" if L>1 else None, schedule=sch)
                errs.append(np.abs(np.array(o.astype(mx.float32))-ref).max())
            row.append(f"S={S}:"+"/".join(f"{e:.3f}" for e in errs))
        print(dtype, b,hq,hkv,L, " ".join(row), flush=True)
