//! Batches from arrays: five index columns, or block tables over planes. Both are expanded into
//! the op list here, so a 2048-block batch costs no Python loop.

use numpy::{PyArray1, dtype};
use numpy::{PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::agent::BlockOp;
use crate::error::{Error, Result};

/// Where one plane of blocks lies in a segment: block `i` is `block_bytes` at
/// `base + i * stride` in region `region`. A KV cache of L layers with K and V planes is 2L
/// planes sharing one list of block ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plane {
    pub region: u32,
    pub base: u64,
    pub stride: u64,
    pub block_bytes: u64,
}

/// A 1-d integer array (numpy, or anything `numpy.asarray` takes) as u64 values; negative
/// values are refused, naming `field` and the index.
pub fn indexes(obj: &Bound<'_, PyAny>, field: &str) -> Result<Vec<u64>> {
    let py = obj.py();
    let py_err = |e: PyErr| Error::invalid(field, obj.to_string(), e.to_string());
    let array = match obj.cast::<PyUntypedArray>() {
        Ok(a) => a.clone(),
        Err(_) => py
            .import("numpy")
            .and_then(|np| np.call_method1("asarray", (obj,)))
            .map_err(py_err)?
            .cast_into::<PyUntypedArray>()
            .map_err(|e| py_err(e.into()))?,
    };
    if array.ndim() != 1 {
        return Err(Error::invalid(
            field,
            format!("shape {:?}", array.shape()),
            "must be a 1-d integer array",
        ));
    }
    macro_rules! take {
        ($($t:ty),*) => {$(
            if array.dtype().is_equiv_to(&dtype::<$t>(py)) {
                let a = array.cast::<PyArray1<$t>>().map_err(|e| py_err(e.into()))?;
                let view = a.readonly();
                let mut out = Vec::with_capacity(view.len());
                for (i, &v) in view.as_array().iter().enumerate() {
                    #[allow(unused_comparisons)]
                    if v < 0 {
                        return Err(Error::invalid(format!("{field}[{i}]"), v, "must be ≥ 0"));
                    }
                    out.push(v as u64);
                }
                return Ok(out);
            }
        )*};
    }
    take!(u64, i64, u32, i32, u16, i16, u8, i8);
    Err(Error::invalid(
        field,
        format!("dtype {}", array.dtype()),
        "must be an integer array",
    ))
}

/// Region indexes: like [`indexes`], each below 2^32.
pub fn region_indexes(obj: &Bound<'_, PyAny>, field: &str) -> Result<Vec<u32>> {
    indexes(obj, field)?
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            u32::try_from(v)
                .map_err(|_| Error::invalid(format!("{field}[{i}]"), v, "a region index is < 2^32"))
        })
        .collect()
}

/// The op list of five columns of equal length.
pub fn from_columns(
    local_regions: &[u32],
    local_offsets: &[u64],
    remote_regions: &[u32],
    remote_offsets: &[u64],
    lengths: &[u64],
) -> Result<Vec<BlockOp>> {
    let n = local_regions.len();
    for (field, len) in [
        ("local_offsets", local_offsets.len()),
        ("remote_regions", remote_regions.len()),
        ("remote_offsets", remote_offsets.len()),
        ("lengths", lengths.len()),
    ] {
        if len != n {
            return Err(Error::invalid(
                field,
                format!("{len} entries"),
                format!("every column must have local_regions' length ({n})"),
            ));
        }
    }
    Ok((0..n)
        .map(|i| BlockOp {
            local_region: local_regions[i],
            local_offset: local_offsets[i],
            remote_region: remote_regions[i],
            remote_offset: remote_offsets[i],
            len: lengths[i],
        })
        .collect())
}

/// The op list of a block table: for each plane pair, block `local_ids[k]` of the local plane
/// and `remote_ids[k]` of the remote one. Plane-major, so runs of consecutive ids stay adjacent
/// for the agent to coalesce.
pub fn from_planes(
    local: &[Plane],
    remote: &[Plane],
    local_ids: &[u64],
    remote_ids: &[u64],
) -> Result<Vec<BlockOp>> {
    if local.is_empty() || local.len() != remote.len() {
        return Err(Error::invalid(
            "remote_planes",
            format!("{} planes", remote.len()),
            format!(
                "needs one plane per local plane ({}), at least one",
                local.len()
            ),
        ));
    }
    if local_ids.len() != remote_ids.len() {
        return Err(Error::invalid(
            "remote_block_ids",
            format!("{} ids", remote_ids.len()),
            format!("needs one id per local block id ({})", local_ids.len()),
        ));
    }
    let offset = |side: &str, p: &Plane, k: usize, id: u64| -> Result<u64> {
        id.checked_mul(p.stride)
            .and_then(|o| o.checked_add(p.base))
            .ok_or_else(|| {
                Error::invalid(
                    format!("{side}_block_ids[{k}]"),
                    id,
                    format!(
                        "block offset overflows (base {}, stride {})",
                        p.base, p.stride
                    ),
                )
            })
    };
    let mut ops = Vec::with_capacity(local.len() * local_ids.len());
    for (i, (l, r)) in local.iter().zip(remote).enumerate() {
        if l.block_bytes != r.block_bytes || l.block_bytes == 0 {
            return Err(Error::invalid(
                format!("remote_planes[{i}].block_bytes"),
                r.block_bytes,
                format!("must equal the local plane's, {} (> 0)", l.block_bytes),
            ));
        }
        for (k, (&lid, &rid)) in local_ids.iter().zip(remote_ids).enumerate() {
            ops.push(BlockOp {
                local_region: l.region,
                local_offset: offset("local", l, k, lid)?,
                remote_region: r.region,
                remote_offset: offset("remote", r, k, rid)?,
                len: l.block_bytes,
            });
        }
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plane(region: u32, base: u64, stride: u64, block_bytes: u64) -> Plane {
        Plane {
            region,
            base,
            stride,
            block_bytes,
        }
    }

    #[test]
    fn planes_expand_plane_major_with_each_side_own_layout() {
        // Two planes (K at 0, V at 1000) locally; remotely interleaved blocks of a 2x stride.
        let local = [plane(0, 0, 100, 64), plane(0, 1000, 100, 64)];
        let remote = [plane(3, 0, 200, 64), plane(3, 100, 200, 64)];
        let ops = from_planes(&local, &remote, &[1, 2], &[5, 0]).unwrap();
        let got: Vec<_> = ops
            .iter()
            .map(|o| {
                (
                    o.local_region,
                    o.local_offset,
                    o.remote_region,
                    o.remote_offset,
                    o.len,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (0, 100, 3, 1000, 64),
                (0, 200, 3, 0, 64),
                (0, 1100, 3, 1100, 64),
                (0, 1200, 3, 100, 64),
            ]
        );
    }

    #[test]
    fn planes_refuse_mismatches_and_overflow_naming_the_field() {
        let p = plane(0, 0, 4096, 4096);
        let e = from_planes(&[p], &[], &[0], &[0]).unwrap_err().to_string();
        assert!(e.contains("remote_planes"), "{e}");
        let e = from_planes(&[p], &[p], &[0, 1], &[0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("remote_block_ids"), "{e}");
        let e = from_planes(&[p], &[plane(0, 0, 4096, 2048)], &[0], &[0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("remote_planes[0].block_bytes"), "{e}");
        let e = from_planes(&[p], &[p], &[0, u64::MAX / 2], &[0, 0])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("local_block_ids[1]") && e.contains("overflows"),
            "{e}"
        );
        let big = plane(0, u64::MAX, 1, 1);
        let e = from_planes(&[p], &[big], &[0], &[1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("remote_planes[0].block_bytes"), "{e}");
        let e = from_planes(&[big], &[big], &[0], &[1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("remote_block_ids[0]"), "{e}");
    }

    #[test]
    fn columns_must_have_one_length() {
        let ops = from_columns(&[0, 1], &[0, 8], &[2, 3], &[16, 24], &[8, 8]).unwrap();
        assert_eq!(ops[1].local_region, 1);
        assert_eq!(ops[1].remote_offset, 24);
        let e = from_columns(&[0, 1], &[0, 8], &[2, 3], &[16], &[8, 8])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("remote_offsets") && e.contains("1 entries"),
            "{e}"
        );
    }
}
