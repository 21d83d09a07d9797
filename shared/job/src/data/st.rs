//! Safetensors data files (via the `safetensors` crate), one named tensor per
//! reference.

use super::raw::{ElemType, RawArray};
use crate::error::JobError;
use crate::spec::DataRef;
use crate::weights::parse_safetensors;

pub(crate) fn read(r: &DataRef) -> Result<RawArray, JobError> {
    let file_shown = r.path.display().to_string();
    let bytes = std::fs::read(&r.path)
        .map_err(|e| JobError::file(&file_shown, format!("cannot read: {e}")))?;
    let st = parse_safetensors(&bytes, &file_shown)?;
    let mut names: Vec<&String> = st.names();
    names.sort();
    let name = match &r.member {
        Some(m) => m.clone(),
        None => match names.as_slice() {
            [only] => (*only).clone(),
            _ => {
                return Err(JobError::file(
                    &file_shown,
                    format!(
                        "holds {} tensors ({}): name one as `{file_shown}:NAME`",
                        names.len(),
                        names
                            .iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
        },
    };
    let source = format!("{file_shown}:{name}");
    let view = st.tensor(&name).map_err(|_| {
        JobError::file(
            &file_shown,
            format!(
                "has no tensor `{name}` (it holds: {})",
                names
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    })?;
    use safetensors::Dtype;
    let elem = match view.dtype() {
        Dtype::BOOL | Dtype::U8 => ElemType::U8,
        Dtype::I8 => ElemType::I8,
        Dtype::U16 => ElemType::U16,
        Dtype::I16 => ElemType::I16,
        Dtype::U32 => ElemType::U32,
        Dtype::I32 => ElemType::I32,
        Dtype::U64 => ElemType::U64,
        Dtype::I64 => ElemType::I64,
        Dtype::F16 => ElemType::F16,
        Dtype::BF16 => ElemType::Bf16,
        Dtype::F32 => ElemType::F32,
        Dtype::F64 => ElemType::F64,
        other => {
            return Err(JobError::file(
                &source,
                format!("unsupported dtype {other:?}"),
            ));
        }
    };
    RawArray::new(
        view.shape().to_vec(),
        elem,
        false,
        view.data().to_vec(),
        source,
    )
}
