//! Batches from arrays: five index columns (expanded into the op list here, so a 2048-block
//! batch costs no Python loop), or block tables over planes (sent as they are: the agent and the
//! engine take them natively).

use numpy::{PyArray1, dtype};
use numpy::{PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::agent::{BlockOp, pb};
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
    // `numpy.asarray([])` is float64: an empty list has no values to convert, whatever its
    // dtype, and the agent says what it needs instead.
    if array.len() == 0 {
        return Ok(Vec::new());
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

/// A block table as the agent takes it, unexpanded: for each plane pair, block `local_ids[k]`
/// of the local plane moves with `remote_ids[k]` of the remote one. The agent checks it per
/// plane (bounds of the largest ids, destinations apart) and the engine expands it where the
/// copy happens (on a GPU, the kernel itself), so a 2048-block batch costs its planes and ids.
pub fn from_planes(
    local: &[Plane],
    remote: &[Plane],
    local_ids: &[u64],
    remote_ids: &[u64],
) -> Result<pb::BlockTable> {
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
    let ids = |side: &str, ids: &[u64]| -> Result<Vec<u32>> {
        ids.iter()
            .enumerate()
            .map(|(k, &id)| {
                u32::try_from(id).map_err(|_| {
                    Error::invalid(format!("{side}_block_ids[{k}]"), id, "a block id is < 2^32")
                })
            })
            .collect()
    };
    let side = |p: &Plane| pb::PlaneSide {
        region: p.region,
        base: p.base,
        stride: p.stride,
    };
    let mut planes = Vec::with_capacity(local.len());
    for (i, (l, r)) in local.iter().zip(remote).enumerate() {
        if l.block_bytes != r.block_bytes || l.block_bytes == 0 {
            return Err(Error::invalid(
                format!("remote_planes[{i}].block_bytes"),
                r.block_bytes,
                format!("must equal the local plane's, {} (> 0)", l.block_bytes),
            ));
        }
        planes.push(pb::Plane {
            local: Some(side(l)),
            remote: Some(side(r)),
            block_bytes: l.block_bytes,
        });
    }
    Ok(pb::BlockTable {
        planes,
        local_blocks: ids("local", local_ids)?,
        remote_blocks: ids("remote", remote_ids)?,
    })
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
    fn planes_become_the_agents_table_with_each_side_own_layout() {
        // Two planes (K at 0, V at 1000) locally; remotely interleaved blocks of a 2x stride.
        let local = [plane(0, 0, 100, 64), plane(0, 1000, 100, 64)];
        let remote = [plane(3, 0, 200, 64), plane(3, 100, 200, 64)];
        let t = from_planes(&local, &remote, &[1, 2], &[5, 0]).unwrap();
        let sides: Vec<_> = t
            .planes
            .iter()
            .map(|p| {
                let (l, r) = (p.local.unwrap(), p.remote.unwrap());
                (
                    l.region,
                    l.base,
                    l.stride,
                    r.region,
                    r.base,
                    r.stride,
                    p.block_bytes,
                )
            })
            .collect();
        assert_eq!(
            sides,
            [(0, 0, 100, 3, 0, 200, 64), (0, 1000, 100, 3, 100, 200, 64)]
        );
        assert_eq!((t.local_blocks, t.remote_blocks), (vec![1, 2], vec![5, 0]));
    }

    #[test]
    fn planes_refuse_mismatches_and_wide_ids_naming_the_field() {
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
        let e = from_planes(&[p], &[p], &[0, 1 << 32], &[0, 0])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("local_block_ids[1]") && e.contains("2^32"),
            "{e}"
        );
        let zero = plane(0, 0, 1, 0);
        let e = from_planes(&[zero], &[zero], &[0], &[1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("remote_planes[0].block_bytes"), "{e}");
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
