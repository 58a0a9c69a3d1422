//! The agents' ServiceAccount; agents need no API access, so it gets no token.

use k8s_openapi::api::core::v1::ServiceAccount;
use kvfabric_crds::TransferFabric;

use crate::Result;
use crate::meta::{child_meta, fabric_labels, name_and_namespace, service_account_name};

/// The desired ServiceAccount `<fabric>-agent`.
pub fn desired_service_account(fabric: &TransferFabric) -> Result<ServiceAccount> {
    let (name, _) = name_and_namespace(fabric)?;
    Ok(ServiceAccount {
        metadata: child_meta(fabric, service_account_name(&name), fabric_labels(&name))?,
        automount_service_account_token: Some(false),
        ..ServiceAccount::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::full;

    #[test]
    fn named_owned_and_tokenless() {
        let sa = desired_service_account(&full()).expect("builds");
        assert_eq!(sa.metadata.name.as_deref(), Some("tf-agent"));
        assert_eq!(sa.metadata.namespace.as_deref(), Some("llm"));
        assert!(sa.metadata.owner_references.is_some());
        assert_eq!(sa.automount_service_account_token, Some(false));
    }
}
